"""Encoding of requests and results: msgpack (default) or JSON, with hard size limits.

No pickle, no msgpack ext types: only maps, arrays, strings, numbers, booleans, nil.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgpack
from pydantic import ValidationError

from .errors import ErrorCode, RequestRejected
from .keys import REQUEST_ID
from .messages import DEFAULT_LIMITS, Format, Limits, Request, Result

MSGPACK_FIELD = b"msgpack"
JSON_FIELD = b"json"
"""A lane-stream entry has exactly one of these fields, holding the encoded request."""


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed")


def unpack(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode msgpack with every container and string bounded by ``limits``."""
    if len(data) > limits.max_entry_bytes:
        raise ValueError(f"{len(data)} bytes > max_entry_bytes {limits.max_entry_bytes}")
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        ext_hook=_no_ext,
        max_str_len=max(limits.max_text_chars * 4, 4096),
        max_bin_len=0,
        max_array_len=max(limits.max_inputs, 4096),
        max_map_len=max(limits.max_metadata_items, 64),
        max_ext_len=0,
    )


def pack(obj: Any) -> bytes:
    """Encode with msgpack; floats as float32 (outputs do not need more)."""
    return msgpack.packb(obj, use_bin_type=True, use_single_float=True)


# --- requests -------------------------------------------------------------------------------


def encode_request(request: Request, fmt: Format = "msgpack") -> dict[bytes, bytes]:
    """The field map to XADD for ``request``."""
    body = request.model_dump(mode="json", exclude_none=True, exclude_defaults=False)
    if fmt == "json":
        return {JSON_FIELD: json.dumps(body, separators=(",", ":")).encode()}
    return {MSGPACK_FIELD: msgpack.packb(body, use_bin_type=True)}


@dataclass(slots=True)
class Envelope:
    """What could be read from an entry even when it is invalid: enough to answer it."""

    id: str | None = None
    reply: str | None = None
    format: Format = "msgpack"
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def answerable(self) -> bool:
        return self.id is not None


def _code_of(exc: ValidationError) -> ErrorCode:
    for err in exc.errors():
        msg = str(err.get("msg", ""))
        for code in (ErrorCode.TOO_LARGE, ErrorCode.EMPTY_INPUT):
            if f"{code.value}:" in msg:
                return code
        if err.get("type") == "too_long":
            return ErrorCode.TOO_LARGE
    return ErrorCode.INVALID_REQUEST


def _envelope(body: Any, fmt: Format) -> Envelope:
    env = Envelope(format=fmt)
    if not isinstance(body, dict):
        return env
    rid = body.get("id")
    if isinstance(rid, str) and REQUEST_ID.match(rid):
        env.id = rid
    reply = body.get("reply")
    if isinstance(reply, str) and 0 < len(reply) <= 256:
        env.reply = reply
    if body.get("format") in ("msgpack", "json"):
        env.format = body["format"]
    meta = body.get("metadata")
    if isinstance(meta, dict) and len(meta) <= 16:
        env.metadata = {
            k: v
            for k, v in meta.items()
            if isinstance(k, str) and isinstance(v, str) and len(k) <= 256 and len(v) <= 256
        }
    return env


def envelope_of(fields: dict[bytes, bytes], limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Best effort: the id and reply target of an entry that may be valid or not."""
    try:
        if MSGPACK_FIELD in fields:
            return _envelope(unpack(fields[MSGPACK_FIELD], limits), "msgpack")
        if JSON_FIELD in fields:
            return _envelope(json.loads(fields[JSON_FIELD]), "json")
    except Exception:
        pass
    return Envelope()


class EntryRejected(RequestRejected):
    """An entry failed to decode or validate; ``envelope`` says whom to answer."""

    def __init__(self, message: str, code: ErrorCode, envelope: Envelope) -> None:
        super().__init__(message, code)
        self.envelope = envelope


def decode_entry(
    fields: dict[bytes, bytes], model: str, limits: Limits = DEFAULT_LIMITS
) -> tuple[Request, Format]:
    """Decode and validate one stream entry served for ``model``.

    Returns the request and the format it arrived in; raises :class:`EntryRejected`.
    """
    fmt: Format
    if MSGPACK_FIELD in fields:
        fmt, raw = "msgpack", fields[MSGPACK_FIELD]
    elif JSON_FIELD in fields:
        fmt, raw = "json", fields[JSON_FIELD]
    else:
        names = sorted(k.decode(errors="replace") for k in fields)
        raise EntryRejected(
            f"entry has no 'msgpack' or 'json' field (fields: {names})",
            ErrorCode.MALFORMED,
            Envelope(),
        )
    if len(raw) > limits.max_entry_bytes:
        raise EntryRejected(
            f"entry is {len(raw)} bytes > max_entry_bytes {limits.max_entry_bytes}",
            ErrorCode.TOO_LARGE,
            Envelope(format=fmt),
        )
    try:
        body = unpack(raw, limits) if fmt == "msgpack" else json.loads(raw)
    except Exception as exc:
        raise EntryRejected(
            f"cannot decode {fmt}: {type(exc).__name__}: {exc}",
            ErrorCode.MALFORMED,
            Envelope(format=fmt),
        ) from None
    if not isinstance(body, dict):
        raise EntryRejected(
            f"{fmt} body must be a map, got {type(body).__name__}",
            ErrorCode.MALFORMED,
            _envelope(body, fmt),
        )
    if body.get("model") != model and isinstance(body.get("model"), str):
        raise EntryRejected(
            f"unknown model {body['model']!r} on the stream of model {model!r}",
            ErrorCode.UNKNOWN_MODEL,
            _envelope(body, fmt),
        )
    try:
        request = Request.model_validate(body, context={"limits": limits})
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}"
            for e in exc.errors()[:5]
        )
        raise EntryRejected(detail, _code_of(exc), _envelope(body, fmt)) from None
    return request, request.format or fmt


# --- results --------------------------------------------------------------------------------


def encode_result(result: Result, fmt: Format = "msgpack") -> bytes:
    body = result.model_dump(mode="json", exclude_none=True)
    if fmt == "json":
        return json.dumps(body, separators=(",", ":")).encode()
    return pack(body)


def decode_result(data: bytes | str) -> Result:
    """Decode a stored or published result in either encoding (JSON starts with '{')."""
    if isinstance(data, str):
        data = data.encode()
    if data[:1] == b"{":
        return Result.model_validate_json(data)
    return Result.model_validate(msgpack.unpackb(data, raw=False, ext_hook=_no_ext))
