"""batchfleet's generation results and deltas → OpenAI's Responses API answers: the
``response`` object, whole (:func:`response`), or streamed as its semantic events
(:class:`ResponseEvents`).

A response's output items are, in order, a ``reasoning`` item (the result's
``reasoning_content``), a ``message`` (its ``content``, or its text) and one
``function_call`` per tool call. Their ids come from the request's (``msg_<id>``,
``rs_<id>``) and the calls' (``fc_<call id>``), so a stream's items and its final response
name the same items, and a request sent again with its id gets the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...producer.tokens import Restarted
from ...schemas.messages import Delta, Generation, Result, TokenLogprob, Usage
from ...schemas.tools import ToolCallChunk
from .answers import chat_logprobs
from .endpoint import Answered
from .replay import Replay
from .response_input import wants_logprobs

__all__ = ["ResponseEvents", "response"]


def usage(u: Usage | None) -> dict[str, Any]:
    """The Responses API's ``usage`` (the fleet does not count reasoning tokens apart: 0)."""
    prompt, completion = (u.prompt_tokens, u.completion_tokens) if u else (0, 0)
    cached = u.prompt_tokens_details.cached_tokens if u and u.prompt_tokens_details else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def status(g: Generation) -> tuple[str, dict[str, Any] | None]:
    """The response's ``status`` and ``incomplete_details`` from its finish reason."""
    if g.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if g.finish_reason == "deadline":
        return "incomplete", {"reason": None}
    if g.finish_reason == "cancelled":
        return "cancelled", None
    return "completed", None


def echoed(was: Mapping[str, Any]) -> Answered:
    """A stored response's id, creation time and the sampling it echoed (a background
    response's later forms echo what its first did)."""
    sampling = {k: was[k] for k in ("temperature", "top_p") if was.get(k) is not None}
    return Answered(was["id"], was["created_at"], sampling=sampling)


def settings(body: Mapping[str, Any], answered: Answered, model: str) -> dict[str, Any]:
    """A response object in progress: its id, and the request's settings echoed (the
    model's sampling defaults where the request gave none, else the fleet's: greedy,
    ``top_p`` 1)."""
    text: dict[str, Any] = {"format": {"type": "text"}}
    if isinstance(body.get("text"), Mapping):
        text |= {k: v for k, v in body["text"].items() if v is not None}
    reasoning = body.get("reasoning")
    return {
        "id": answered.id,
        "object": "response",
        "created_at": answered.created,
        "status": "in_progress",
        "background": body.get("background") is True,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": body.get("previous_response_id"),
        "conversation": body.get("conversation"),  # {"id": ...}, as respond.py puts it
        "reasoning": dict(reasoning) if isinstance(reasoning, Mapping) else None,
        "store": body.get("store") is not False,
        "temperature": body.get("temperature", answered.sampling.get("temperature", 0.0)),
        "text": text,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"),
        "top_p": body.get("top_p", answered.sampling.get("top_p", 1.0)),
        "truncation": body.get("truncation") or "disabled",
        "usage": None,
        "user": body.get("user"),
    }


def _logprobs(lps: list[TokenLogprob] | None) -> list[dict[str, Any]] | None:
    """``output_text.logprobs``: each token, its log-probability, bytes and the likeliest."""
    out = chat_logprobs(lps)
    return None if out is None else list(out["content"])


def _event_logprobs(lps: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    """The text events' ``logprobs`` (no bytes)."""
    return [{"token": t.text, "logprob": t.logprob,
             "top_logprobs": [{"token": x.text, "logprob": x.logprob} for x in t.top]}
            for t in lps or ()]  # fmt: skip


def _suffix(answered: Answered) -> str:
    return answered.id.removeprefix("resp_")


@dataclass
class _Item:
    """An output item: what its final form is built from."""

    kind: str
    """``reasoning``, ``message`` or ``function_call``."""
    id: str
    text: str = ""
    """The reasoning, the message's text, or the call's arguments."""
    call_id: str = ""
    name: str = ""

    def final(self, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The item as a response's ``output`` holds it."""
        if self.kind == "function_call":
            return {"type": "function_call", "id": self.id, "call_id": self.call_id,
                    "name": self.name, "arguments": self.text, "status": status}  # fmt: skip
        if self.kind == "reasoning":
            return {"type": "reasoning", "id": self.id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": self.text}]}  # fmt: skip
        return {"type": "message", "id": self.id, "role": "assistant", "status": status,
                "content": [self.part(logprobs)]}  # fmt: skip

    def part(self, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A text item's content part."""
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        part = {"type": "output_text", "text": self.text, "annotations": []}
        return part if logprobs is None else part | {"logprobs": logprobs}


def _items(g: Generation, suffix: str) -> list[_Item]:
    """A generation's output items, in order."""
    items = []
    if g.reasoning_content:
        items.append(_Item("reasoning", f"rs_{suffix}", g.reasoning_content))
    content = g.content if g.content is not None else g.text
    if content or not g.tool_calls:
        items.append(_Item("message", f"msg_{suffix}", content))
    for c in g.tool_calls or ():
        items.append(_Item("function_call", f"fc_{c.id}", c.function.arguments, c.id,
                           c.function.name))  # fmt: skip
    return items


def _generation(result: Result) -> Generation:
    gens = result.generations()
    return gens[0] if gens else Generation(text="", finish_reason="stop")


def _finished(body: Mapping[str, Any], result: Result, answered: Answered,
              output: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    g = _generation(result)
    state, details = status(g)
    done = result.finished_at_ms / 1000 if result.finished_at_ms else None
    return settings(body, answered, result.model) | {
        "status": state,
        "incomplete_details": details,
        "output": output,
        "usage": usage(result.usage),
        "completed_at": done if state == "completed" else None,
    }


def response(body: Mapping[str, Any], result: Result, answered: Answered) -> dict[str, Any]:
    """The whole ``response`` of an ``ok`` result."""
    g = _generation(result)
    state = "incomplete" if status(g)[0] != "completed" else "completed"
    lps = _logprobs(g.logprobs) if wants_logprobs(body) else None
    output = [i.final("completed" if i.kind == "function_call" else state, lps)
              for i in _items(g, _suffix(answered))]  # fmt: skip
    return _finished(body, result, answered, output)


class ResponseEvents:
    """One stream's events: ``response.created`` and ``response.in_progress`` with the
    first output, each item opened (``output_item.added``, ``content_part.added``), its
    text or arguments as they come, each closed once the result is in (``*.done``) with the
    result's final text, then ``response.completed`` (or ``response.incomplete``) with the
    whole response. ``sequence_number`` counts from 0."""

    def __init__(self, body: Mapping[str, Any], answered: Answered, model: str) -> None:
        self.body, self.answered, self.model = body, answered, model
        self.logprobs = wants_logprobs(body)
        self.replay = Replay()
        self.seq = 0
        self.begun = False
        self.items: list[_Item] = []
        """Opened, by output index."""
        self.text: dict[str, _Item] = {}
        """The reasoning and the message, by kind."""
        self.calls: dict[int, _Item] = {}
        """By their chunks' ``index``."""
        self.held: list[TokenLogprob] = []
        """Log-probabilities of tokens that showed no text yet."""

    def _begin(self) -> list[dict[str, Any]]:
        """The events that open the stream, before its first output."""
        self.begun = True
        begun = settings(self.body, self.answered, self.model)
        return [{"type": "response.created", "response": begun},
                {"type": "response.in_progress", "response": begun}]  # fmt: skip

    def _number(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``events`` numbered (the opening ones first, before the first output)."""
        if events and not self.begun:
            events = [*self._begin(), *events]
        return self._numbered(events)

    def _numbered(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for e in events:
            e["sequence_number"] = self.seq
            self.seq += 1
        return events

    def _where(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item)}

    def _open(self, item: _Item) -> list[dict[str, Any]]:
        self.items.append(item)
        opened = item.final("in_progress")
        if item.kind != "function_call":
            opened["content"] = []
        out = [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": opened}]  # fmt: skip
        if item.kind != "function_call":
            part = _Item(item.kind, item.id).part([] if item.kind == "message" else None)
            out.append({"type": "response.content_part.added", **self._where(item),
                        "content_index": 0, "part": part})  # fmt: skip
        return out

    def _add(self, kind: str, piece: str, lps: list[TokenLogprob] | None = None) -> list[Any]:
        """Text added to the reasoning or the message (opened first)."""
        out = []
        item = self.text.get(kind)
        if item is None:
            item = self.text[kind] = _Item(kind, f"{'rs' if kind == 'reasoning' else 'msg'}_"
                                                 f"{_suffix(self.answered)}")  # fmt: skip
            out += self._open(item)
        item.text += piece
        event = {"type": "response.output_text.delta", **self._where(item), "content_index": 0,
                 "delta": piece}  # fmt: skip
        if kind == "reasoning":
            event["type"] = "response.reasoning_text.delta"
        else:
            event["logprobs"] = _event_logprobs(lps)
        return [*out, event]

    def _chunk(self, chunk: ToolCallChunk) -> list[dict[str, Any]]:
        """A piece of a call: its first opens its ``function_call`` item."""
        out = []
        item = self.calls.get(chunk.index)
        if item is None:
            call_id = chunk.id or f"call_{self.answered.id}_{chunk.index}"
            item = self.calls[chunk.index] = _Item("function_call", f"fc_{call_id}",
                                                   call_id=call_id, name=chunk.function.name or "")  # fmt: skip
            out += self._open(item)
        if chunk.function.arguments:
            item.text += chunk.function.arguments
            out.append({"type": "response.function_call_arguments.delta", **self._where(item),
                        "delta": chunk.function.arguments})  # fmt: skip
        return out

    def feed(self, event: Delta | Restarted) -> list[dict[str, Any]]:
        """The events one event of the token stream makes (maybe none)."""
        if isinstance(event, Restarted):
            self.replay.restart()
            return []
        if not self.replay.fresh(event):
            return []
        out: list[dict[str, Any]] = []
        if event.reasoning_content:
            out += self._add("reasoning", event.reasoning_content)
        content = event.content if event.content is not None else event.text
        if self.logprobs and event.logprobs:
            self.held += event.logprobs
        if content:
            out += self._add("message", content, self.held)
            self.held = []
        for chunk in event.tool_call_chunks or ():
            out += self._chunk(chunk)
        return self._number(out)

    def _close(
        self, item: _Item, final: _Item, state: str, tokens: list[TokenLogprob] | None
    ) -> list[dict[str, Any]]:
        """The events that end ``item``: what the result adds to its text, then its ``done``s
        (``tokens``: the log-probabilities asked for). A text the result does not continue
        keeps what was streamed: ``minicpm5``'s result leaves out the thinking that its
        stream's content kept, and vLLM's ``done`` events are its deltas' sum."""
        out = []
        lps = _logprobs(tokens)
        if final.text.startswith(item.text) and final.text != item.text:
            rest = final.text[len(item.text) :]
            if item.kind == "function_call":
                item.text = final.text
                out.append({"type": "response.function_call_arguments.delta",
                            **self._where(item), "delta": rest})  # fmt: skip
            else:
                out += self._add(item.kind, rest)
        if item.kind == "function_call" or final.text.startswith(item.text):
            item.text = final.text
        where = self._where(item)
        if item.kind == "function_call":
            out.append({"type": "response.function_call_arguments.done", **where,
                        "arguments": item.text})  # fmt: skip
        else:
            kind = "output_text" if item.kind == "message" else "reasoning_text"
            done = {"type": f"response.{kind}.done", **where, "content_index": 0,
                    "text": item.text}  # fmt: skip
            if item.kind == "message":
                done["logprobs"] = _event_logprobs(tokens)
            out.append(done)
            out.append({"type": "response.content_part.done", **where, "content_index": 0,
                        "part": item.part(lps)})  # fmt: skip
        out.append({"type": "response.output_item.done", "output_index": where["output_index"],
                    "item": item.final(state, lps)})  # fmt: skip
        return out

    def finish(self, result: Result) -> list[dict[str, Any]]:
        """The last events: each item closed with the result's final text (an item the
        deltas did not open is opened first; a call they opened that the result does not
        hold is closed ``incomplete`` and left out of the response), then the response."""
        g = _generation(result)
        state = "incomplete" if status(g)[0] != "completed" else "completed"
        tokens = g.logprobs if self.logprobs else None
        finals = {i.id: i for i in _items(g, _suffix(self.answered))}
        out: list[dict[str, Any]] = []
        for final in finals.values():
            if all(i.id != final.id for i in self.items):
                blank = _Item(final.kind, final.id, call_id=final.call_id, name=final.name)
                if final.kind != "function_call":
                    self.text[final.kind] = blank
                out += self._open(blank)
        output = []
        for item in list(self.items):
            held = finals.get(item.id)
            call_state = "completed" if held is not None else "incomplete"
            item_state = call_state if item.kind == "function_call" else state
            out += self._close(item, held or item, item_state, tokens)
            if held is not None:  # the whole response's, as the result's (vLLM's too)
                output.append(held.final(item_state, _logprobs(tokens)))
        whole = _finished(self.body, result, self.answered, output)
        end = "response.completed" if whole["status"] == "completed" else "response.incomplete"
        out.append({"type": end, "response": whole})
        return self._number(out)
