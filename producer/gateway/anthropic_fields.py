"""Anthropic's Messages API request (``POST /v1/messages``) → batchfleet's submit options.

The body is rewritten as the chat completion vLLM's Anthropic route makes of it (the
system text first, ``tool_use`` blocks as an assistant's ``tool_calls``, each
``tool_result`` as a ``tool`` message, Anthropic's tools and ``tool_choice`` as OpenAI's)
and that is translated by :func:`~.openai_fields.chat_submission`: both routes take a
value the same way, and the producer's own validation answers bad ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .endpoint import Submission
from .errors import invalid
from .openai_fields import SAME_NAME, chat_submission

PASSED = (*(f for f in SAME_NAME if f not in ("n", "prompt_logprobs", "return_token_ids")),
          "chat_template_kwargs")  # fmt: skip
"""Fields taken as the chat route takes them: Anthropic's ``temperature``, ``top_p`` and
``top_k``, and vLLM's and batchfleet's extras whose answer has a place in Anthropic's."""

TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
THINKING = {"enabled": True, "adaptive": True, "disabled": False}
"""``thinking.type`` → the chat template's ``enable_thinking`` (Qwen3's and the like)."""
BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's first system block: a hash per request that would defeat prefix caching
(vLLM leaves it out too)."""


def submission(body: Mapping[str, Any], counting: bool = False) -> Submission:
    """``/v1/messages``: ``max_tokens`` is required, as Anthropic's API has it;
    ``counting`` (``/v1/messages/count_tokens``): none, the same prompt with nothing
    generated (``max_new_tokens`` 0)."""
    if body.get("max_tokens") is None and not counting:
        raise invalid("max_tokens is required", "max_tokens")
    chat: dict[str, Any] = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat |= {"model": body.get("model"), "max_tokens": None if counting else body["max_tokens"],
             "messages": messages(body), "stream": bool(body.get("stream")) and not counting}  # fmt: skip
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools:
        chat["tools"] = [function(t, f"tools[{i}]") for i, t in enumerate(_list(tools, "tools"))]
    if body.get("tool_choice") is not None:
        chat |= tool_choice(body["tool_choice"], bool(tools))
    if body.get("thinking") is not None:
        chat["chat_template_kwargs"] = thinking(body["thinking"], chat.get("chat_template_kwargs"))
    chat |= output_config(body.get("output_config"))
    sub = chat_submission(chat)
    return Submission(sub.model, sub.options | {"max_new_tokens": 0}) if counting else sub


def _list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(f"{param} must be a list", param)
    return value


def _object(value: Any, param: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise invalid(f"{param} must be an object", param)
    return value


def messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat: the system text (``system`` and any ``system`` turn, as vLLM takes them)
    first, then each turn's messages."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty list", "messages")
    system = [] if body.get("system") is None else [text_of(body["system"], "system")]
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if _object(m, param).get("role") == "system":
            system.append(text_of(m.get("content"), f"{param}.content"))
        else:
            out += turn(m, param)
    system = [s for s in system if s]
    return ([{"role": "system", "content": "\n".join(system)}] if system else []) + out


def text_of(content: Any, param: str) -> str:
    """A string, or ``text`` blocks joined by newlines (as the chat route joins parts)."""
    if isinstance(content, str):
        return content
    texts = [_text(b, f"{param}[{j}]") for j, b in enumerate(_list(content, param))]
    return "\n".join(t for t in texts if not (param == "system" and t.startswith(BILLING_HEADER)))


def _text(block: Any, param: str) -> str:
    kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
    if kind != "text" or not isinstance(block.get("text"), str):
        raise invalid(f"a content block of type {kind!r} where this gateway takes text blocks "
                      "only", param)  # fmt: skip
    return str(block["text"])


def turn(m: Mapping[str, Any], param: str) -> list[dict[str, Any]]:
    """One user or assistant turn as chat messages: a user's ``tool_result`` blocks each a
    ``tool`` message (first), the rest one message; an assistant's ``tool_use`` blocks its
    ``tool_calls``, its ``thinking`` its ``reasoning_content``."""
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise invalid("a message's role is user or assistant", f"{param}.role")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(_list(content, f"{param}.content")):
        where = f"{param}.content[{j}]"
        kind = (role, block.get("type") if isinstance(block, Mapping) else None)
        if kind[1] == "text":
            texts.append(_text(block, where))
        elif kind == ("assistant", "tool_use"):
            calls.append(past_call(block, where))
        elif kind == ("assistant", "thinking") and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == ("user", "tool_result"):
            results.append(tool_message(block, where))
        elif kind != ("assistant", "redacted_thinking"):  # opaque: left out
            raise invalid(f"a {role} message's content block of type {kind[1]!r}: this gateway "
                          "takes text, tool_use and thinking (assistant) and tool_result (user) "
                          "blocks", where)  # fmt: skip
    if results and not (texts or calls or thinking):
        return results
    message: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts or not calls
                               else None}  # fmt: skip
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return [*results, message]


def past_call(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    """A ``tool_use`` block as OpenAI's call: ``input`` as compact JSON text (as results
    write ``arguments``)."""
    arguments = json.dumps(_object(block.get("input", {}), f"{param}.input"), ensure_ascii=False,
                           separators=(",", ":"))  # fmt: skip
    return {"id": block.get("id"), "type": "function",
            "function": {"name": block.get("name"), "arguments": arguments}}  # fmt: skip


def tool_message(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    """A ``tool_result`` block as a ``tool`` message; one with ``is_error`` reads
    ``Error: ...`` (a chat template has no other way to tell the model)."""
    content = block.get("content")
    text = "" if content is None else text_of(content, f"{param}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}


def function(tool: Any, param: str) -> dict[str, Any]:
    """A custom tool (``name``, ``description``, ``input_schema``) as OpenAI's function;
    Anthropic's own tools (bash, web search, ...) are not served."""
    kind = _object(tool, param).get("type")
    if kind not in (None, "custom"):
        raise invalid(f"a tool of type {kind!r}: this gateway takes custom tools (name, "
                      "description, input_schema)", param)  # fmt: skip
    fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    fn |= {k: tool[k] for k in ("description", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def tool_choice(choice: Any, tools: bool) -> dict[str, Any]:
    """``auto``, ``any`` (OpenAI's ``required``), ``tool`` (that function) or ``none``;
    ``disable_parallel_tool_use``: one call at most. Without tools, ``auto`` and ``none``
    mean nothing and are left out."""
    kind = _object(choice, "tool_choice").get("type")
    if kind == "tool":
        out: dict[str, Any] = {"tool_choice": {"type": "function",
                                               "function": {"name": choice.get("name")}}}  # fmt: skip
    elif kind in TOOL_CHOICE:
        out = {"tool_choice": TOOL_CHOICE[kind]} if tools or kind == "any" else {}
    else:
        raise invalid(f"tool_choice type {kind!r}: auto, any, tool or none", "tool_choice.type")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def thinking(value: Any, kwargs: Any) -> dict[str, Any]:
    """``thinking`` as the template's ``enable_thinking`` (``budget_tokens`` is not
    enforced), unless ``chat_template_kwargs`` sets it."""
    kind = _object(value, "thinking").get("type")
    if kind not in THINKING:
        raise invalid(f"thinking type {kind!r}: enabled, adaptive or disabled", "thinking.type")
    return {"enable_thinking": THINKING[kind], **_object(kwargs or {}, "chat_template_kwargs")}


def output_config(value: Any) -> dict[str, Any]:
    """``format`` (a JSON schema the text follows) and ``effort`` (``reasoning_effort``)."""
    if value is None:
        return {}
    out: dict[str, Any] = {}
    fmt = _object(value, "output_config").get("format")
    if fmt is not None:
        schema = _object(fmt, "output_config.format").get("schema")
        if fmt.get("type") != "json_schema" or schema is None:
            raise invalid("output_config.format is {type: json_schema, schema}",
                          "output_config.format")  # fmt: skip
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": schema}}  # fmt: skip
    if value.get("effort") is not None:
        out["reasoning_effort"] = value["effort"]
    return out
