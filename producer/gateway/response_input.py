"""OpenAI's Responses API request (``POST /v1/responses``) → the chat submission it means.

The ``instructions`` and ``input`` items become chat messages and the Responses fields
their chat-completions names; :func:`~.openai_fields.chat_submission` does the rest, so
both routes submit the same request for the same chat and the producer's validation
answers a bad value (400). A ``previous_response_id`` is the handler's to resolve
(``respond.py``: its stored conversation is put in ``input``); what needs state the gateway
does not keep (a stored prompt) and OpenAI's built-in tools are refused with 400 and the
field as ``param``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .endpoint import Submission
from .errors import invalid
from .openai_fields import SAME_NAME, chat_submission, text_parts

STATEFUL = ("prompt",)
"""Fields that name state kept on OpenAI's side (the gateway keeps responses and
conversations only)."""
ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
               "reasoning": "rs"}  # fmt: skip
"""Of the ids given to input items sent without one (``input_items`` lists them by id)."""

NOT_TAKEN = ("n", "response_format", "prompt_logprobs", "return_token_ids")
EXTRAS = (
    *(n for n in SAME_NAME if n not in NOT_TAKEN), "stop", "min_tokens", "logit_bias",
    "chat_template_kwargs", "request_id", "parallel_tool_calls", "stream",
)  # fmt: skip
"""Fields taken as chat takes them (OpenAI's, vLLM's extras and batchfleet's own); not ``n``
(a response has one output) nor the fields a response has no place for."""

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"
"""The ``include`` entry that asks for the output text's log-probabilities."""


def response_submission(body: Mapping[str, Any]) -> Submission:
    """``/v1/responses``: the chat submission of :func:`chat_body`."""
    return chat_submission(chat_body(body))


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body that asks what this Responses body asks."""
    for name in STATEFUL:
        if body.get(name) is not None:
            raise invalid(f"{name} is not supported: continue a conversation with "
                          "conversation or previous_response_id, or send it whole as input",
                          name)  # fmt: skip
    chat = {k: body[k] for k in ("model", *EXTRAS) if body.get(k) is not None}
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    chat["messages"] = messages + input_messages(body.get("input"))
    if body.get("max_output_tokens") is not None:
        if body["max_output_tokens"] == 0:  # the fleet's prompt only: no Responses answer
            raise invalid("max_output_tokens must be at least 1", "max_output_tokens")
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools must be a list", "tools")
        if tools:
            chat["tools"] = [function_tool(t, i) for i, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice(body["tool_choice"])
    fmt = response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    if wants_logprobs(body):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs")
    return chat


def wants_logprobs(body: Mapping[str, Any]) -> bool:
    include = body.get("include")
    return isinstance(include, list) and LOGPROBS in include


def input_items(raw: Any) -> list[dict[str, Any]]:
    """``input`` as a list of items (a text: one user message), as a response stores it."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": raw}]}]  # fmt: skip
    if not isinstance(raw, list) or not raw:
        raise invalid("input must be a text or a non-empty list of items", "input")
    return list(raw)


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """``input`` (a text, or a list of items) as chat messages, as vLLM builds them
    (``construct_chat_messages_with_tool_call``): an assistant turn spans the items that
    make it, so a ``reasoning`` item (its ``reasoning_content``), an assistant message (its
    ``content``) and ``function_call`` items (its ``tool_calls``) join the assistant message
    before them where it lacks that part yet, else begin one; a call's output is a
    ``tool`` message."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid("input must be a text or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise invalid("each input item must be an object", param)
        kind = item.get("type", "message")
        turn = out[-1] if out and out[-1]["role"] == "assistant" else None
        if kind == "message":
            message = _message(item, param)
            if message["role"] == "assistant" and turn is not None and turn["content"] is None:
                turn["content"] = message["content"]
            else:
                out.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
            if turn is not None:
                turn.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = text_parts(output, f"{param}.output", TEXT_PARTS)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            reasoning = _reasoning(item, param)
            if turn is not None and turn.get("reasoning_content") is None:
                turn["reasoning_content"] = reasoning
            else:
                out.append({"role": "assistant", "content": None, "reasoning_content": reasoning})
        else:
            raise invalid(f"input items of type {kind!r} are not supported (messages, "
                          "reasoning, function calls and their outputs are)", f"{param}.type")  # fmt: skip
    for m in out:  # a turn of reasoning only: no text (as vLLM renders it), not a null one
        if m["role"] == "assistant" and m["content"] is None and "tool_calls" not in m:
            m["content"] = ""
    return out


def _reasoning(item: Mapping[str, Any], param: str) -> str:
    """A ``reasoning`` item's text, as vLLM reads it: its first ``content`` part's, else
    its first ``summary`` part's (none: empty); encrypted reasoning is refused (only
    OpenAI reads it)."""
    if item.get("encrypted_content") is not None:
        raise invalid("encrypted reasoning (encrypted_content) is not supported",
                      f"{param}.encrypted_content")  # fmt: skip
    for field in ("content", "summary"):
        parts = item.get(field)
        if parts is None or parts == []:
            continue
        if not isinstance(parts, list) or not isinstance(parts[0], Mapping):
            raise invalid(f"a reasoning item's {field} is a list of parts", f"{param}.{field}")
        text = parts[0].get("text")
        if not isinstance(text, str):
            raise invalid("a reasoning part's text must be a string", f"{param}.{field}[0].text")
        return text
    return ""


def _message(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"a message's role is one of {', '.join(ROLES)}", f"{param}.role")
    content = item.get("content")
    if isinstance(content, list):
        content = text_parts(content, f"{param}.content", TEXT_PARTS)
    elif not isinstance(content, str):
        raise invalid("a message's content is a text or a list of parts", f"{param}.content")
    return {"role": role, "content": content}


def function_tool(tool: Any, index: int) -> dict[str, Any]:
    """A Responses function tool (flat) as chat's (``function`` nested)."""
    if not isinstance(tool, Mapping):
        raise invalid("each tool must be an object", f"tools[{index}]")
    kind = tool.get("type")
    if kind != "function":
        raise invalid(f"tools of type {kind!r} are not supported: the gateway serves function "
                      "tools only (built-in tools run on OpenAI's side)", f"tools[{index}].type")  # fmt: skip
    fields = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in fields if tool.get(k) is not None}}


def tool_choice(choice: Any) -> Any:
    """``auto``, ``none``, ``required`` as they are; a named function as chat names it."""
    if not isinstance(choice, Mapping):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise invalid(f"tool_choice of type {choice.get('type')!r} is not supported (auto, none, "
                  "required or a function are)", "tool_choice")  # fmt: skip


def response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: free text)."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise invalid("text must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, Mapping)
        fields = ("name", "description", "schema", "strict")
        return {"type": "json_schema",
                "json_schema": {k: fmt[k] for k in fields if fmt.get(k) is not None}}  # fmt: skip
    raise invalid("text.format.type is one of text, json_object, json_schema",
                  "text.format.type")  # fmt: skip
