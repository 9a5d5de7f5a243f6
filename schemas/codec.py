"""Encoding of requests and results: msgpack (default) or JSON, with hard size limits.

No pickle, no msgpack ext types: only maps, arrays, strings, numbers, booleans, nil, and
``bin`` for image inputs (schemas/inputs.py), bounded by the entry size.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
from pydantic import ValidationError

from .errors import ErrorCode, RequestRejected
from .keys import REQUEST_ID
from .messages import (
    DEFAULT_LIMITS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    Delta,
    Format,
    Limits,
    Request,
    Result,
    TokenLogprob,
)
from .tools import ToolCall, ToolCallChunk
from .wire import FROM_WIRE

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
        max_bin_len=limits.max_entry_bytes,
        # twice the longest arrays a request may hold (its inputs, a ranking's documents,
        # a prompt's token ids: at most max_text_chars, allowed_token_ids), so that one
        # over its bound is answered too_large by the checks, not malformed here
        max_array_len=2
        * max(
            limits.max_inputs,
            limits.inputs.max_documents,
            limits.max_text_chars,
            MAX_ALLOWED_TOKEN_IDS,
            4096,
        ),
        max_map_len=max(limits.max_metadata_items, 64, 4 * MAX_LOGIT_BIAS),
        max_ext_len=0,
    )


def pack(obj: Any) -> bytes:
    """Encode with msgpack; floats as float32 (outputs do not need more)."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True, use_single_float=True)
    return packed


# --- requests -------------------------------------------------------------------------------


def encode_request(request: Request, fmt: Format = "msgpack") -> dict[bytes, bytes]:
    """The field map to XADD for ``request``."""
    if fmt == "json":  # image bytes become {"image_b64": ...}
        body = request.model_dump(mode="json", exclude_none=True, exclude_defaults=False)
        return {JSON_FIELD: json.dumps(body, separators=(",", ":")).encode()}
    body = request.model_dump(mode="python", exclude_none=True, exclude_defaults=False)
    return {MSGPACK_FIELD: msgpack.packb(body, use_bin_type=True)}  # image bytes as bin


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
    fmt: Format
    try:
        if MSGPACK_FIELD in fields:
            raw, fmt = fields[MSGPACK_FIELD], "msgpack"
        elif JSON_FIELD in fields:
            raw, fmt = fields[JSON_FIELD], "json"
        else:
            return Envelope()
        if len(raw) > limits.max_entry_bytes:
            return oversized_envelope(raw, fmt)
        return _envelope(unpack(raw, limits) if fmt == "msgpack" else json.loads(raw), fmt)
    except Exception:
        return Envelope()


# --- the envelope of an entry too large to decode -------------------------------------------

ENVELOPE_KEYS = frozenset({"id", "reply", "format", "metadata"})
MAX_TOP_LEVEL_KEYS = 64
"""A request map has at most 10 keys; a body with more is not read for its envelope."""
MAX_JSON_TOKENS = 100_000
"""Bounded work: a JSON body is scanned for its envelope through at most this many tokens."""


def oversized_envelope(raw: bytes, fmt: str) -> Envelope:
    """The envelope of an entry over ``max_entry_bytes``, read with bounded work, so that it
    is answered ``too_large`` rather than left unanswered (issue #15: "Every entry whose id
    can be read gets a result"). Only the top-level keys are read: big values are skipped
    without being decoded. Returns an envelope without id when the id cannot be read."""
    try:
        found = _msgpack_top_level(raw) if fmt == "msgpack" else _json_top_level(raw)
    except Exception:
        found = {}
    return _envelope(found, "json" if fmt == "json" else "msgpack")


def _msgpack_top_level(raw: bytes) -> dict[str, Any]:
    unpacker = msgpack.Unpacker(
        io.BytesIO(raw),
        raw=False,
        strict_map_key=True,
        ext_hook=_no_ext,
        max_buffer_size=max(len(raw), 65_536),  # a skipped value must fit in the buffer
        max_str_len=4096,  # limits bound what is decoded; skip() decodes nothing
        max_bin_len=0,
        max_array_len=64,
        max_map_len=64,
        max_ext_len=0,
    )
    found: dict[str, Any] = {}
    count = unpacker.read_map_header()
    if count > MAX_TOP_LEVEL_KEYS:
        return found
    try:
        for _ in range(count):
            key = unpacker.unpack()
            if key in ENVELOPE_KEYS:
                found[key] = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:
        pass  # keys read before the fault stand
    return found


_JSON_TOKEN = re.compile(
    r'\s*(?:(?P<str>"[^"\\]*(?:\\.[^"\\]*)*")|(?P<open>[\[{])|(?P<close>[\]}])'
    r'|(?P<sep>[,:])|(?P<scalar>[^\s\[\]{},:"]+))'
)

_JSON_SPACE = re.compile(r"\s*")


class _JsonScan:
    """Tokens of a JSON text, for walking its top level without decoding big values."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.budget = MAX_JSON_TOKENS

    def token(self) -> tuple[str, str]:
        self.budget -= 1
        match = _JSON_TOKEN.match(self.text, self.pos)
        if self.budget < 0 or match is None or match.lastgroup is None:
            raise ValueError("no envelope within the scan budget")
        self.pos = match.end()
        return match.lastgroup, match.group(match.lastgroup)

    def skip_value(self) -> None:
        depth = 0
        while True:
            kind, _ = self.token()
            depth += {"open": 1, "close": -1}.get(kind, 0)
            if depth <= 0 and kind != "sep":
                return

    def value(self) -> Any:
        start = _JSON_SPACE.match(self.text, self.pos)
        value, self.pos = json.JSONDecoder().raw_decode(self.text, start.end() if start else 0)
        return value


def _json_top_level(raw: bytes) -> dict[str, Any]:
    scan = _JsonScan(raw.decode())
    found: dict[str, Any] = {}
    if scan.token() != ("open", "{"):
        return found
    try:
        while True:
            kind, text = scan.token()
            if kind != "str":
                return found
            key = json.loads(text)
            if scan.token() != ("sep", ":"):
                return found
            if key in ENVELOPE_KEYS:
                found[key] = scan.value()
            else:
                scan.skip_value()
            if scan.token() != ("sep", ","):
                return found
    except Exception:
        return found  # keys read before the fault stand


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
            oversized_envelope(raw, fmt),
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


def encode_delta(delta: Delta, fmt: Format = "msgpack") -> bytes:
    """A delta message for a reply channel, in the request's encoding (the worker's
    ``tokens.lua`` builds the same in Redis; tests hold both equal to ``model_dump``)."""
    body = {
        "v": delta.v, "kind": delta.kind, "id": delta.id, "model": delta.model,
        "seq": delta.seq, "input": delta.input, "text": delta.text, "tokens": delta.tokens,
    }  # fmt: skip
    if delta.logprobs is not None:
        body["logprobs"] = [lp.model_dump(exclude_none=True) for lp in delta.logprobs]
    if delta.tool_calls is not None:
        body["tool_calls"] = [c.model_dump() for c in delta.tool_calls]
    if delta.tool_call_chunks is not None:
        body["tool_call_chunks"] = [c.model_dump(exclude_none=True) for c in delta.tool_call_chunks]
    if delta.token_ids is not None:
        body["token_ids"] = delta.token_ids
    if delta.content is not None:
        body["content"] = delta.content
    if delta.reasoning_content is not None:
        body["reasoning_content"] = delta.reasoning_content
    if delta.prompt_tokens is not None:
        body["prompt_tokens"] = delta.prompt_tokens
    if delta.prompt_text is not None:
        body["prompt_text"] = delta.prompt_text
    if delta.prompt_logprobs is not None:
        body["prompt_logprobs"] = [None if lp is None else lp.model_dump(exclude_none=True)
                                   for lp in delta.prompt_logprobs]  # fmt: skip
    if delta.prompt_token_ids is not None:
        body["prompt_token_ids"] = delta.prompt_token_ids
    if fmt == "json":
        return json.dumps(body, separators=(",", ":")).encode()
    return pack(body)


def delta_fields(delta: Delta) -> dict[bytes, bytes]:
    """A delta as a token-stream entry (flat fields, readable from any language;
    ``logprobs``, where the request asked, ``tool_calls``, where the delta completed
    calls, ``tool_call_chunks``, where it wrote some, and ``token_ids``, where the request
    asked, as JSON text; ``content`` and ``reasoning_content`` where the output has them;
    ``prompt_tokens`` in each output's first; ``prompt_text``, and ``prompt_logprobs`` and
    ``prompt_token_ids`` as JSON text, where the delta has them)."""
    fields = {
        b"seq": str(delta.seq).encode(),
        b"input": str(delta.input).encode(),
        b"text": delta.text.encode(),
        b"tokens": str(delta.tokens).encode(),
    }
    if delta.logprobs is not None:
        fields[b"logprobs"] = logprobs_json(delta.logprobs).encode()
    if delta.tool_calls is not None:
        fields[b"tool_calls"] = tool_calls_json(delta.tool_calls).encode()
    if delta.tool_call_chunks is not None:
        fields[b"tool_call_chunks"] = tool_chunks_json(delta.tool_call_chunks).encode()
    if delta.token_ids is not None:
        fields[b"token_ids"] = token_ids_json(delta.token_ids).encode()
    if delta.content is not None:
        fields[b"content"] = delta.content.encode()
    if delta.reasoning_content is not None:
        fields[b"reasoning_content"] = delta.reasoning_content.encode()
    if delta.prompt_tokens is not None:
        fields[b"prompt_tokens"] = str(delta.prompt_tokens).encode()
    if delta.prompt_text is not None:
        fields[b"prompt_text"] = delta.prompt_text.encode()
    if delta.prompt_logprobs is not None:
        fields[b"prompt_logprobs"] = prompt_logprobs_json(delta.prompt_logprobs).encode()
    if delta.prompt_token_ids is not None:
        fields[b"prompt_token_ids"] = token_ids_json(delta.prompt_token_ids).encode()
    return fields


def logprobs_json(logprobs: Sequence[TokenLogprob] | Sequence[dict[str, Any]]) -> str:
    """A delta's ``logprobs`` as its token-stream field holds them (compact JSON)."""
    plain = [
        lp.model_dump(exclude_none=True) if isinstance(lp, TokenLogprob) else lp for lp in logprobs
    ]
    return json.dumps(plain, separators=(",", ":"), ensure_ascii=False)


def prompt_logprobs_json(
    logprobs: Sequence[TokenLogprob | None] | Sequence[dict[str, Any] | None],
) -> str:
    """A delta's ``prompt_logprobs`` as its token-stream field holds them (compact JSON; the
    first token's null kept)."""
    plain = [
        lp.model_dump(exclude_none=True) if isinstance(lp, TokenLogprob) else lp for lp in logprobs
    ]
    return json.dumps(plain, separators=(",", ":"), ensure_ascii=False)


def tool_calls_json(calls: Sequence[ToolCall] | Sequence[dict[str, Any]]) -> str:
    """A delta's ``tool_calls`` as its token-stream field holds them (compact JSON)."""
    plain = [c.model_dump() if isinstance(c, ToolCall) else c for c in calls]
    return json.dumps(plain, separators=(",", ":"), ensure_ascii=False)


def tool_chunks_json(chunks: Sequence[ToolCallChunk] | Sequence[dict[str, Any]]) -> str:
    """A delta's ``tool_call_chunks`` as its token-stream field holds them (compact JSON,
    a chunk's absent parts left out)."""
    plain = [c.model_dump(exclude_none=True) if isinstance(c, ToolCallChunk) else c
             for c in chunks]  # fmt: skip
    return json.dumps(plain, separators=(",", ":"), ensure_ascii=False)


def token_ids_json(ids: Sequence[int]) -> str:
    """A delta's ``token_ids`` as its token-stream field holds them (compact JSON)."""
    return json.dumps(list(ids), separators=(",", ":"))


def end_fields(seq: int) -> dict[bytes, bytes]:
    """The token stream's last entry, written once the result is stored."""
    return {b"seq": str(seq).encode(), b"end": b"1"}


def decode_delta(body: Any) -> Delta | None:
    """A reply-channel message (decoded map) as a delta, or None if it is not one."""
    if not (isinstance(body, dict) and body.get("kind") == "delta" and body.get("v", 1) == 1):
        return None
    try:
        return Delta.model_validate(body, context={FROM_WIRE: True})
    except ValidationError:
        return None


def _loads(data: bytes | str) -> Any:
    """A result body in either encoding (JSON starts with '{')."""
    if isinstance(data, str):
        data = data.encode()
    if data[:1] == b"{":
        return json.loads(data)
    return msgpack.unpackb(data, raw=False, ext_hook=_no_ext)


def result_map(data: bytes | str) -> dict[str, Any]:
    """A stored result as the plain map it is, every field kept (also those this version
    does not know): for passing a result on unchanged, e.g. in a webhook body."""
    body = _loads(data)
    if not isinstance(body, dict):
        raise ValueError(f"a result is a map, got {type(body).__name__}")
    return body


def decode_result(data: bytes | str) -> Result:
    """Decode a stored or published result in either encoding, as a tolerant reader: unknown
    fields are ignored and an unknown ``status`` or ``error.code`` is kept as its string
    (docs/protocol.md, "What may change within v1")."""
    return Result.model_validate(_loads(data), context={FROM_WIRE: True})


def decode_message(data: bytes | str) -> Result | Delta | None:
    """A reply-channel message: a result, a delta, or ``None`` (not a v1 message we know),
    decoded once."""
    try:
        body = _loads(data)
    except Exception:
        return None
    if isinstance(body, dict) and body.get("kind") == "delta":
        return decode_delta(body)
    return _result_of(body)


def decode_reply(data: bytes | str) -> Result | None:
    """A message from a reply channel: its result, or ``None`` for a message that is not a v1
    result — a map whose ``kind`` (absent in results) is not ``"result"``, a body without a
    string ``id`` and ``status``, or garbage. Readers skip those."""
    try:
        body = _loads(data)
    except Exception:
        return None
    return _result_of(body)


def _result_of(body: Any) -> Result | None:
    if not (
        isinstance(body, dict)
        and body.get("kind", "result") == "result"
        and body.get("v", 1) == 1
        and isinstance(body.get("id"), str)
        and isinstance(body.get("status"), str)
    ):
        return None
    try:
        return Result.model_validate(body, context={FROM_WIRE: True})
    except ValidationError:
        return None
