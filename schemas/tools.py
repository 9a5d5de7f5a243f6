"""Tool calling on chat requests to a generation model: OpenAI's ``tools`` and
``tool_choice``, as vLLM serves them.

The tools are rendered into the prompt by the model's chat template. ``tool_choice``
``"required"`` or a named function constrains the text to JSON (vLLM's schemas: a
non-empty array of ``{"name", "parameters"}`` calls, or the named function's arguments),
so the result's ``tool_calls`` always parse; ``"auto"`` (the default when tools are
given) leaves the text free, and the worker reads calls out of it with the model's
``tool_call_parser``; ``"none"`` reads none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import Field

from .wire import _Answer, _Strict

MAX_TOOLS: Final = 128
"""The most tools a request lists (OpenAI's bound)."""
MAX_TOOLS_CHARS: Final = 65_536
"""The most chars a request's tools take as JSON."""
FUNCTION_NAME: Final = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_ARGUMENTS_CHARS: Final = 65_536


class FunctionDef(_Strict):
    """A function the model may call."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    """A JSON Schema of its arguments (an object); none: it takes any object."""
    strict: bool | None = None
    """OpenAI's: with ``tool_choice`` ``auto``, a call of it follows ``parameters``
    (where the model's format is one the worker holds so: ``hermes``, ``longcat``,
    ``granite``, ``hunyuan_a13b``, ``minimax``, ``mistral``, ``llama3_json``, ``deepseek_v3``, ``deepseek_v31``,
    ``kimi_k2``, ``qwen3_coder``, ``seed_oss``, ``minimax_m2``, ``glm45``, ``deepseek_v32``,
    ``gigachat3`` (3.1's ``<|function_call|>`` token), ``openai`` (gpt-oss), and their
    other names);
    ``required`` and named calls always do."""


class Tool(_Strict):
    """OpenAI's ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS)
    """Its arguments as JSON text."""


class PastToolCall(_Strict):
    """A call the assistant made earlier in the chat (an assistant message's
    ``tool_calls``); the tool's answer is a later ``tool`` message with its id."""

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionCall(_Answer):
    name: str
    arguments: str
    """JSON text (parse it: it is not checked against the function's schema unless the
    request's ``tool_choice`` constrained it)."""


class ToolCall(_Answer):
    """A call the model made (an output's ``tool_calls``)."""

    id: str
    type: str = "function"
    function: FunctionCall


class FunctionChunk(_Answer):
    name: str | None = None
    """In a call's first chunk only."""
    arguments: str = ""
    """What this chunk adds to the call's ``arguments``."""


class ToolCallChunk(_Answer):
    """A piece of a call being written (a delta's ``tool_call_chunks``: OpenAI's
    ``delta.tool_calls``): its first has ``id``, ``type`` and the function's ``name``, and
    each adds to its ``arguments``; a call's pieces (same ``index``) add up to the call."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionChunk


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How a request's text holds its tool calls."""

    kind: Literal["auto", "required", "named"]
    name: str | None = None
    """The function to call (``named``)."""
    parallel: bool = True
    """Several calls may come (OpenAI's ``parallel_tool_calls``); False: one at most."""


def tool_use(
    tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None = None
) -> ToolUse | None:
    """What ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask (None: no calls to
    read)."""
    if not tools or choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        return ToolUse("named", choice.function.name, False)
    return ToolUse("required" if choice == "required" else "auto", None, parallel is not False)


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None, chat: bool) -> None:
    """Raise ValueError where ``tools`` and ``tool_choice`` do not go together."""
    if tools is None:
        if choice is not None and choice != "none":
            raise ValueError("tool_choice other than none needs tools")
        return
    if not chat:
        raise ValueError("tools go with a chat (messages): the chat template renders them")
    if not tools or len(tools) > MAX_TOOLS:
        raise ValueError(f"tools lists 1 to {MAX_TOOLS} functions")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names are unique")
    size = len(json.dumps([t.model_dump(exclude_none=True) for t in tools], default=str))
    if size > MAX_TOOLS_CHARS:
        raise ValueError(f"too_large: tools take {size} chars as JSON > {MAX_TOOLS_CHARS}")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"tool_choice names {choice.function.name!r}, not one of the tools")


def calls_schema(tools: list[Tool], use: ToolUse) -> dict[str, Any] | None:
    """The JSON Schema the text follows (vLLM's): the named function's arguments, or a
    non-empty array of ``{"name", "parameters"}`` calls of the tools, with no other keys
    (vLLM's allows others: a small model writes on, adding keys until its text is cut);
    None for ``auto``."""
    if use.kind == "named":
        (fn,) = (t.function for t in tools if t.function.name == use.name)
        return _parameters(fn)
    if use.kind == "required":
        calls = [
            {
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": _parameters(t.function),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        one = {} if use.parallel else {"maxItems": 1}
        return {"type": "array", "minItems": 1, **one, "items": {"type": "object", "anyOf": calls}}
    return None


def called(tools: list[Tool], use: ToolUse) -> list[tuple[str, dict[str, Any]]]:
    """The functions a call that ``use`` (``required`` or named) asks for may call, each
    with its parameters' JSON Schema."""
    fns = [t.function for t in tools if use.kind != "named" or t.function.name == use.name]
    return [(fn.name, _parameters(fn)) for fn in fns]


def _parameters(fn: FunctionDef) -> dict[str, Any]:
    return fn.parameters if fn.parameters else {"type": "object", "properties": {}}
