"""Building and validating requests, shared by the sync and asyncio producers."""

from __future__ import annotations

import importlib.resources
import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ..schemas.codec import encode_request
from ..schemas.errors import ErrorCode, QueueFull, RequestRejected, Unavailable
from ..schemas.keys import ModelKeys, check_model_name
from ..schemas.messages import (
    DEFAULT_LIMITS,
    ChatMessage,
    Format,
    Limits,
    Request,
    StructuredOutputs,
    Webhook,
)

WebhookArg = str | Webhook | Mapping[str, Any] | None
"""A webhook URL, or a :class:`Webhook` / map with ``url``, ``secret_id``, ``format``."""
Chat = Sequence[ChatMessage | Mapping[str, Any]]
"""Chat messages: ``[{"role": "user", "content": "..."}, ...]`` or :class:`ChatMessage` objects."""

DEFAULT_LANES = 3
LANES_CACHE_S = 30.0


InputArg = str | bytes | tuple[str, str] | Mapping[str, Any] | BaseModel
"""One input: a text, image bytes, a ``(text, text_pair)`` tuple, or an input map / model
(schemas/inputs.py)."""
InputsArg = str | bytes | Mapping[str, Any] | BaseModel | Iterable[InputArg] | None
"""A request's inputs: one input (a text, an image, an input map), or a list of inputs."""


def new_request_id() -> str:
    return uuid.uuid4().hex


def is_chat(item: object) -> bool:
    """Whether a ``submit_many`` item is a chat (messages) rather than input texts."""
    return (
        not isinstance(item, str)
        and isinstance(item, Sequence)
        and bool(item)
        and isinstance(item[0], ChatMessage | Mapping)
    )


def gather_inputs(
    inputs: InputsArg = None,
    *,
    images: Iterable[bytes] | None = None,
    pairs: Iterable[tuple[str, str]] | None = None,
    query: str | None = None,
    documents: Iterable[str] | None = None,
    top_n: int | None = None,
) -> list[Any]:
    """One list of wire inputs from ``submit``'s ways of giving them: ``inputs`` (texts, or
    any kind), ``images=[bytes, ...]``, ``pairs=[(query, doc), ...]``, and ``query`` with
    ``documents`` (one ranking input, ``top_n`` best)."""
    out: list[Any] = []
    if inputs is not None:
        one = isinstance(inputs, str | bytes | Mapping | BaseModel)  # a map: one input
        items = [inputs] if one else list(inputs)
        out += [_wire_input(i) for i in items]
    out += [_wire_input(bytes(b)) for b in images or ()]
    out += [_wire_input(tuple(p)) for p in pairs or ()]
    if (query is None) != (documents is None):
        raise RequestRejected("give query and documents together", ErrorCode.INVALID_REQUEST)
    if query is not None and documents is not None:
        ranking: dict[str, Any] = {"query": query, "documents": list(documents)}
        if top_n is not None:
            ranking["top_n"] = top_n
        out.append(ranking)
    return out


def _wire_input(item: Any) -> Any:
    if isinstance(item, bytearray | memoryview):
        return bytes(item)
    if isinstance(item, tuple) and len(item) == 2 and all(isinstance(t, str) for t in item):
        return {"text": item[0], "text_pair": item[1]}
    if isinstance(item, BaseModel):
        return item.model_dump(exclude_none=True)
    return item


def build_request(
    model: str,
    inputs: InputsArg,
    *,
    messages: Chat | None = None,
    generation: Mapping[str, Any] | None = None,
    limits: Limits = DEFAULT_LIMITS,
    request_id: str | None = None,
    deadline_ms: int | None = None,
    reply: str | None = None,
    result_ttl_s: int | None = None,
    metadata: Mapping[str, str] | None = None,
    result_format: Format | None = None,
    webhook: WebhookArg = None,
) -> Request:
    """Validate a request on the producer side, with the same rules the worker applies.
    ``generation``: the generation fields (``max_new_tokens``, ``stream``...), None left out."""
    check_model_name(model)
    texts = gather_inputs(inputs)
    body: dict[str, Any] = {
        "id": request_id or new_request_id(),
        "model": model,
        "inputs": texts,
        "messages": None if messages is None else [_message(m) for m in messages],
        **_generation_fields(generation or {}),
        "deadline_ms": deadline_ms,
        "reply": reply,
        "result_ttl_s": result_ttl_s,
        "metadata": dict(metadata or {}),
        "format": result_format,
        "webhook": {"url": webhook} if isinstance(webhook, str) else webhook,
    }
    try:
        return Request.model_validate(body, context={"limits": limits})
    except ValidationError as exc:
        msg = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors()
        )
        code = ErrorCode.TOO_LARGE if "too_large" in msg else ErrorCode.INVALID_REQUEST
        if "empty_input" in msg:
            code = ErrorCode.EMPTY_INPUT
        raise RequestRejected(msg, code, _param(exc.errors()[0])) from None


def _param(error: Any) -> str | None:
    """The field a validation error is about: its ``loc`` (``messages[0].content``), or,
    for a check of the whole request, the field its message begins with, if it does
    (``length_penalty goes with use_beam_search``)."""
    loc: tuple[int | str, ...] = tuple(error["loc"])
    if not loc:
        words = str(error["msg"]).removeprefix("Value error, ").split(": ", 1)
        first = re.match(r"\w+", words[-1] if words[0] in ("too_large", "empty_input")
                         else words[0])  # fmt: skip
        name = first.group() if first else ""
        return name if name in Request.model_fields else None
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).removeprefix(".")


def _generation_fields(generation: Mapping[str, Any]) -> dict[str, Any]:
    """The generation fields that are set; ``stop`` and ``bad_words`` as lists (a lone
    string is one)."""
    out = {k: v for k, v in generation.items() if v is not None}
    if "stop" in out:
        out["stop"] = [out["stop"]] if isinstance(out["stop"], str) else list(out["stop"])
    for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
        if name in out:
            out[name] = [out[name]] if isinstance(out[name], str) else list(out[name])
    if "chat_template_kwargs" in out:
        out["chat_template_kwargs"] = dict(out["chat_template_kwargs"])
    if "logit_bias" in out:  # token ids as the wire's string keys
        out["logit_bias"] = {str(k): float(b) for k, b in out["logit_bias"].items()}
    if "structured_outputs" in out:
        out["structured_outputs"] = _structured(out["structured_outputs"])
    if "response_format" in out:
        out["response_format"] = dict(out["response_format"])
    if "tools" in out:
        out["tools"] = [_tool(t) for t in out["tools"]]
    if isinstance(out.get("tool_choice"), Mapping):
        out["tool_choice"] = dict(out["tool_choice"])
    return out


def _tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool as the wire's map; a pydantic model class given as a function's
    ``parameters`` becomes its JSON Schema."""
    out = dict(tool)
    if isinstance(out.get("function"), Mapping):
        fn = out["function"] = dict(out["function"])
        params = fn.get("parameters")
        if isinstance(params, type) and issubclass(params, BaseModel):
            fn["parameters"] = params.model_json_schema()
    return out


def _structured(spec: StructuredOutputs | Mapping[str, Any]) -> Any:
    """``structured_outputs`` as the wire's map; a pydantic model class given as ``json``
    becomes its JSON Schema."""
    if isinstance(spec, StructuredOutputs):
        return spec.model_dump(exclude_none=True)
    out = dict(spec)
    schema = out.get("json")
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        out["json"] = schema.model_json_schema()
    return out


def _message(m: ChatMessage | Mapping[str, Any]) -> Any:
    return m.model_dump(exclude_none=True) if isinstance(m, ChatMessage) else dict(m)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to add with the submit script."""

    stream: str
    fields: dict[bytes, bytes]
    request: Request

    @property
    def keys(self) -> list[str]:
        return [self.stream, ModelKeys(self.request.model).max_depth]

    @property
    def args(self) -> list[bytes]:
        ((name, body),) = self.fields.items()
        return [name, body]


SUBMIT_LUA = (importlib.resources.files(__package__) / "lua" / "submit.lua").read_text()


def queue_full(exc: Exception) -> QueueFull | None:
    """The QueueFull a submit-script error reply stands for, if it is one."""
    text = str(exc)
    return (
        QueueFull(f"queue full: {text.removeprefix('QUEUEFULL ')}") if "QUEUEFULL" in text else None
    )


def split_accepted(
    chunk: Sequence[Prepared], replies: Sequence[object]
) -> tuple[list[Prepared], QueueFull | None]:
    """The pipelined submits that went in, and the QueueFull that refused others."""
    went_in: list[Prepared] = []
    full: QueueFull | None = None
    for p, reply in zip(chunk, replies, strict=True):
        if isinstance(reply, Exception):
            full = queue_full(reply)
            if full is None:
                raise reply
        else:
            went_in.append(p)
    return went_in, full


def unavailable(url: str, exc: Exception, unknown_ids: Sequence[str] = ()) -> Unavailable:
    """The error for an unreachable Redis (the URL without its credentials)."""
    safe = url.split("@")[-1]
    message = f"cannot reach Redis at {safe}: {exc}"
    if unknown_ids:
        message += f"; outcome unknown for {len(unknown_ids)} requests (resubmit them as they are)"
    return Unavailable(message, unknown_ids=unknown_ids)


def prepare(request: Request, lane: int, lanes: int, wire_format: Format) -> Prepared:
    if not 0 <= lane < lanes:
        raise RequestRejected(
            f"priority {lane} out of range: model {request.model!r} has lanes 0..{lanes - 1}",
            ErrorCode.INVALID_REQUEST,
        )
    return Prepared(
        ModelKeys(request.model).lane(lane), encode_request(request, wire_format), request
    )


class LaneCache:
    """Lane counts per model, as published by workers (``bf:{model}:lanes``), cached briefly."""

    def __init__(self, default: int = DEFAULT_LANES) -> None:
        self.default = default
        self._seen: dict[str, tuple[float, int]] = {}

    def get(self, model: str) -> int | None:
        hit = self._seen.get(model)
        if hit and time.monotonic() - hit[0] < LANES_CACHE_S:
            return hit[1]
        return None

    def put(self, model: str, raw: bytes | str | None) -> int:
        lanes = int(raw) if raw else self.default
        self._seen[model] = (time.monotonic(), lanes)
        return lanes
