"""Tool calls read out of a generated text (schemas/tools.py has the request side).

With ``tool_choice`` ``required`` or a named function the text was constrained to JSON
(vLLM's schemas), so it parses unless generation stopped early (``length``, a deadline).
With ``auto`` the text is free and a parser for the model's own format finds the calls:
``hermes`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the
format of Hermes, Qwen 2.5 and 3, and other chat templates that render ``tools``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Final

from ...schemas.tools import ToolUse

PARSERS: Final = ("hermes",)
"""The values of a model's ``tool_call_parser`` option."""
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def read_calls(use: ToolUse, text: str, parser: str | None) -> list[dict[str, Any]] | None:
    """The calls ``text`` makes, as a result's ``tool_calls`` (None: none, or it does
    not parse)."""
    if use.kind == "named":
        assert use.name is not None
        args = _json(text)
        return None if not isinstance(args, dict) else [_call(use.name, args)]
    if use.kind == "required":
        found = _json(text)
        if not isinstance(found, list):
            return None
        calls = [(c.get("name"), c.get("parameters")) for c in found if isinstance(c, dict)]
        return _calls(calls) or None
    if parser == "hermes":
        read = _calls(_hermes(text))
        return (read if use.parallel else read[:1]) or None
    return None


def _hermes(text: str) -> list[tuple[Any, Any]]:
    out = []
    for block in _HERMES.findall(text):
        found = _json(block)
        if isinstance(found, dict):
            out.append((found.get("name"), found.get("arguments", found.get("parameters"))))
    return out


def _calls(found: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
    """Calls with a name and an object of arguments (others are left out)."""
    return [_call(name, args) for name, args in found if isinstance(name, str) and name
            and isinstance(args, dict)]  # fmt: skip


def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    arguments = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
