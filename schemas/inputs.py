"""The kinds of input a request may carry, and their limits (docs/protocol.md, "Inputs").

An input is one of:

- a text: a string (as in every earlier v1 request);
- a text pair, for cross-encoders and NLI: ``{"text": …, "text_pair": …}``;
- a ranking, one query against many documents: ``{"query": …, "documents": […], "top_n": n}``;
- an image: raw bytes (msgpack ``bin``), ``{"image_b64": …}`` (any encoding, for JSON), or
  ``{"image_key": "bf:{<model>}:input:<name>"}``, a Redis key the client wrote the bytes to;
- a prompt as token ids, for generation models: ``{"prompt_token_ids": […]}`` (vLLM's).

Which kinds a model takes is up to its runner; a kind it does not take is ``invalid_input``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainSerializer,
    PrivateAttr,
    Tag,
    field_validator,
)

from .keys import ModelKeys

Kind = Literal["text", "pair", "ranking", "image", "tokens"]
IMAGE_FORMATS: Final = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""Formats a worker can be told to accept (Pillow's names)."""


class InputLimits(BaseModel):
    """Bounds on inputs other than texts (texts keep ``Limits.max_text_chars``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_image_bytes: int = Field(8 * 1_048_576, ge=1024, le=256 * 1_048_576)
    """Encoded size of one image, inline or by reference (inline ones are also held to
    ``max_entry_bytes``)."""
    max_image_pixels: int = Field(4096 * 4096, ge=1, le=1 << 30)
    """Width x height read from the header, checked before the image is decoded: the guard
    against decompression bombs."""
    image_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")
    """Formats decoded at all; any other is ``invalid_input`` (the decoder is never tried)."""
    max_documents: int = Field(256, ge=1, le=4096)
    """Documents of one ranking input."""

    @field_validator("image_formats")
    @classmethod
    def _known_formats(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [f for f in v if f not in IMAGE_FORMATS]
        if bad:
            raise ValueError(f"unknown image formats {bad}: use some of {list(IMAGE_FORMATS)}")
        return v


DEFAULT_INPUT_LIMITS = InputLimits()


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TextPair(_Input):
    """Two texts scored together (a cross-encoder's query and passage, NLI's premise and
    hypothesis)."""

    text: str
    text_pair: str


class Ranking(_Input):
    """One query against many documents: one output, the documents' indices and scores,
    best first (``top_n`` of them; default all)."""

    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1)


class TokenPrompt(_Input):
    """A prompt as token ids (vLLM's ``TokensPrompt``): a generation model takes them as
    they are, not tokenized again (so a client's own tokenization, or an earlier
    generation's ``token_ids``, goes on exactly)."""

    prompt_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]]


class ImageB64(_Input):
    """An image as base64 text, for encodings without a byte type (JSON)."""

    image_b64: str
    _data: bytes = PrivateAttr(b"")

    @field_validator("image_b64")
    @classmethod
    def _is_base64(cls, v: str) -> str:
        try:
            base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("image_b64 is not valid base64") from None
        return v

    @property
    def data(self) -> bytes:
        if not self._data:
            self._data = base64.b64decode(self.image_b64)
        return self._data


class ImageRef(_Input):
    """An image the client wrote to ``bf:{<model>}:input:<name>`` (read, not deleted, by the
    worker)."""

    image_key: str = Field(min_length=1, max_length=256)


@dataclass(frozen=True, slots=True)
class FetchedImage:
    """An :class:`ImageRef` after the worker read its key: the bytes, or None (no key).
    Never on the wire."""

    key: str
    data: bytes | None


def _b64_wire(data: bytes) -> dict[str, str]:
    return {"image_b64": base64.b64encode(data).decode()}


ImageBytes = Annotated[bytes, PlainSerializer(_b64_wire, when_used="json")]
"""Raw image bytes: msgpack ``bin``; written as ``{"image_b64": …}`` in JSON."""


def _tag(v: Any) -> str | None:
    if isinstance(v, str):
        return "text"
    if isinstance(v, bytes):
        return "bytes"
    if isinstance(v, Mapping | BaseModel):
        keys = v.keys() if isinstance(v, Mapping) else type(v).model_fields.keys()
        for key, tag in (("image_b64", "b64"), ("image_key", "ref"), ("query", "ranking"),
                         ("prompt_token_ids", "tokens")):  # fmt: skip
            if key in keys:
                return tag
        return "pair"
    return None


Input = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[ImageBytes, Tag("bytes")]
    | Annotated[TextPair, Tag("pair")]
    | Annotated[Ranking, Tag("ranking")]
    | Annotated[ImageB64, Tag("b64")]
    | Annotated[ImageRef, Tag("ref")]
    | Annotated[TokenPrompt, Tag("tokens")],
    Discriminator(
        _tag,
        custom_error_type="input_kind",
        custom_error_message="an input is a string, bytes, or a map with text+text_pair, "
        "query+documents, image_b64, image_key or prompt_token_ids",
    ),
]
"""One input as it is on the wire."""
AnyInput = str | bytes | TextPair | Ranking | ImageB64 | ImageRef | FetchedImage | TokenPrompt
"""An input as a runner sees it (a reference is fetched by then)."""


def kind_of(item: AnyInput) -> Kind:
    if isinstance(item, str):
        return "text"
    if isinstance(item, TextPair):
        return "pair"
    if isinstance(item, Ranking):
        return "ranking"
    if isinstance(item, TokenPrompt):
        return "tokens"
    return "image"


def image_bytes(item: AnyInput) -> bytes | None:
    """The encoded image of an image input (None: a reference whose key was missing)."""
    if isinstance(item, bytes):
        return item
    if isinstance(item, ImageB64):
        return item.data
    if isinstance(item, FetchedImage):
        return item.data
    raise TypeError(f"not a fetched image input: {type(item).__name__}")


def texts_of(item: AnyInput) -> list[str]:
    """Every text an input carries (none for an image)."""
    if isinstance(item, str):
        return [item]
    if isinstance(item, TextPair):
        return [item.text, item.text_pair]
    if isinstance(item, Ranking):
        return [item.query, *item.documents]
    return []


def check_inputs(
    inputs: Sequence[AnyInput], model: str, max_text_chars: int, limits: InputLimits
) -> None:
    """Raise ``ValueError`` (``too_large:``/``empty_input:`` prefixed where it applies) for
    an input over its limits; the request validator's rules for every kind."""
    for i, item in enumerate(inputs):
        what = "" if isinstance(item, str) else " a text of"
        for text in texts_of(item):
            if not text.strip():
                raise ValueError(f"empty_input: inputs[{i}] is empty")
            if len(text) > max_text_chars:
                raise ValueError(
                    f"too_large: inputs[{i}] has{what} {len(text)} chars > max_text_chars "
                    f"{max_text_chars}"
                )
        if isinstance(item, TokenPrompt):
            if not item.prompt_token_ids:
                raise ValueError(f"empty_input: inputs[{i}] has no prompt_token_ids")
            if len(item.prompt_token_ids) > max_text_chars:  # a token is a char or more
                raise ValueError(
                    f"too_large: inputs[{i}] has {len(item.prompt_token_ids)} "
                    f"prompt_token_ids > max_text_chars {max_text_chars}"
                )
        if isinstance(item, Ranking) and len(item.documents) > limits.max_documents:
            raise ValueError(
                f"too_large: inputs[{i}] has {len(item.documents)} documents > max_documents "
                f"{limits.max_documents}"
            )
        if isinstance(item, bytes | ImageB64):
            size = len(item) if isinstance(item, bytes) else len(item.image_b64) * 3 // 4
            if size == 0:
                raise ValueError(f"empty_input: inputs[{i}] is an empty image")
            if size > limits.max_image_bytes:
                raise ValueError(
                    f"too_large: inputs[{i}] is an image of {size} bytes > max_image_bytes "
                    f"{limits.max_image_bytes}"
                )
        if isinstance(item, ImageRef) and ModelKeys(model).input_name(item.image_key) is None:
            raise ValueError(
                f"inputs[{i}].image_key must be a key {ModelKeys(model).input('<name>')!r} "
                f"(name: 1-128 of A-Z a-z 0-9 _ . : -), got {item.image_key!r}"
            )
