"""Image inputs passed by reference: a client writes the bytes to ``bf:{model}:input:<name>``
and the request carries ``{"image_key": …}`` (docs/protocol.md, "Images by reference").

The intake reads the referenced keys when it reads the entries (its thread, one round
trip per read), so the loop's CPU side finds the bytes in hand; only this model's input
keys are ever read, at most ``max_image_bytes + 1`` bytes of each.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..schemas.codec import JSON_FIELD, MSGPACK_FIELD, unpack
from ..schemas.inputs import FetchedImage, ImageRef
from ..schemas.keys import ModelKeys
from ..schemas.messages import Limits, Request
from .streams import Entry, ModelStreams

MARK = b"image_key"
"""Entries whose body lacks these bytes reference nothing: they are not decoded here."""


def referenced_keys(entry: Entry, keys: ModelKeys, limits: Limits) -> list[str]:
    """This model's input keys named by an entry's inputs (none if it does not decode: the
    loop answers it then)."""
    raw = entry.fields.get(MSGPACK_FIELD) or entry.fields.get(JSON_FIELD)
    if raw is None or MARK not in raw or len(raw) > limits.max_entry_bytes:
        return []
    try:
        body: Any = unpack(raw, limits) if MSGPACK_FIELD in entry.fields else json.loads(raw)
        inputs = body.get("inputs") if isinstance(body, dict) else None
    except Exception:
        return []
    found = [
        i["image_key"]
        for i in (inputs if isinstance(inputs, list) else [])
        if isinstance(i, dict) and isinstance(i.get("image_key"), str)
    ]
    return [k for k in dict.fromkeys(found) if keys.input_name(k) is not None]


def fetch_referenced(
    entries: Sequence[Entry], streams: ModelStreams, limits: Limits
) -> list[Entry]:
    """``entries``, those that reference input keys carrying their blobs."""
    wanted = [referenced_keys(e, streams.keys, limits) for e in entries]
    keys = list(dict.fromkeys(k for ks in wanted for k in ks))
    if not keys:
        return list(entries)
    blobs = dict(zip(keys, streams.read_inputs(keys, limits.inputs.max_image_bytes), strict=True))
    return [
        dataclasses.replace(e, blobs={k: blobs[k] for k in ks}) if ks else e
        for e, ks in zip(entries, wanted, strict=True)
    ]


def with_fetched(request: Request, blobs: Mapping[str, bytes | None] | None) -> Request:
    """``request`` with each image reference replaced by its fetched bytes (None: missing)."""
    if not any(isinstance(i, ImageRef) for i in request.inputs):
        return request
    got = blobs or {}
    inputs = [
        FetchedImage(i.image_key, got.get(i.image_key)) if isinstance(i, ImageRef) else i
        for i in request.inputs
    ]
    return request.model_copy(update={"inputs": inputs})
