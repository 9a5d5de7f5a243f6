"""Pydantic models of every message on the wire: requests, results, and their parts."""

from __future__ import annotations

import json as _json
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ErrorCode
from .inputs import Input, InputLimits, check_inputs
from .keys import MODEL_NAME, REQUEST_ID
from .tools import (
    MAX_TOOLS,
    PastToolCall,
    Tool,
    ToolCall,
    ToolCallChunk,
    ToolChoice,
    ToolUse,
    calls_schema,
    check_tools,
    tool_use,
)
from .wire import FROM_WIRE, _Answer, _Strict

SCHEMA_VERSION: Final = 1
Format = Literal["msgpack", "json"]
Status = Literal["ok", "error", "expired"]
"""The statuses workers of this version write. Readers must accept others (see
docs/protocol.md, "What may change within v1"): a decoded ``Result.status`` is any string."""
OK: Final = "ok"
ERROR: Final = "error"
EXPIRED: Final = "expired"
KNOWN_STATUSES: Final = frozenset({OK, ERROR, EXPIRED})


class Limits(BaseModel):
    """Bounds applied to everything decoded from Redis (and checked again by producers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_entry_bytes: int = Field(1_048_576, ge=256, le=64 * 1_048_576)
    max_inputs: int = Field(64, ge=1, le=4096)
    max_text_chars: int = Field(20_000, ge=1, le=1_000_000)
    max_metadata_items: int = Field(16, ge=0, le=256)
    max_metadata_chars: int = Field(256, ge=1, le=65_536)
    max_result_ttl_s: int = Field(7 * 24 * 3600, ge=1)
    max_messages: int = Field(256, ge=1, le=4096)
    """Chat messages in one generation request."""
    max_new_tokens: int = Field(4096, ge=1, le=1_000_000)
    """The most tokens a generation request may ask for (a model's config may lower it)."""
    max_stop: int = Field(8, ge=0, le=64)
    """Stop strings in one generation request (each at most 256 chars)."""
    inputs: InputLimits = Field(default_factory=InputLimits)
    """Images and rankings (schemas/inputs.py)."""


DEFAULT_LIMITS = Limits()


SECRET_ID = r"^[A-Za-z0-9_.-]{1,64}$"


class Webhook(_Strict):
    """Where to POST a request's result. Secrets live in the fleet file, never in a request."""

    url: str = Field(min_length=8, max_length=2048, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^\s]+$")
    """``https://`` (``http://`` only where the fleet allows it); checked again on delivery."""
    secret_id: str | None = Field(None, pattern=SECRET_ID)
    """Which configured secret signs the delivery; default: the fleet's."""
    format: Format | None = None
    """Body encoding; default ``json``."""


MAX_STOP_TOKEN_IDS: Final = 64
"""The most token ids a request's ``stop_token_ids`` lists."""
MAX_TOP_LOGPROBS: Final = 20
"""The most alternatives a generated token's log-probabilities list (``logprobs``)."""
MAX_LOGIT_BIAS: Final = 300
"""The most tokens a request's ``logit_bias`` lists (OpenAI's bound)."""
MAX_ALLOWED_TOKEN_IDS: Final = 8_192
"""The most token ids a request's ``allowed_token_ids`` lists."""
MAX_BAD_WORDS: Final = 128
"""The most words a request's ``bad_words`` lists (each 1 to 256 chars)."""
MAX_TEMPLATE_KWARGS_CHARS: Final = 4_096
"""The most chars a request's ``chat_template_kwargs`` take as JSON."""
MAX_CHAT_TEMPLATE_CHARS: Final = 65_536
"""The longest chat template a request brings (``chat_template``)."""
TEMPLATE_NAMES: Final = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens",
})  # fmt: skip
"""Arguments of ``apply_chat_template`` that ``chat_template_kwargs`` may not set."""
MAX_COMPLETIONS: Final = 16
"""The most completions a generation request asks per input (``n``)."""
MAX_GRAMMAR_CHARS: Final = 65_536
"""The longest ``structured_outputs`` constraint: a JSON schema (as JSON text), a regex or
a grammar."""
MAX_CHOICES: Final = 1_024
"""The most strings a ``structured_outputs.choice`` lists."""
MAX_STRUCTURES: Final = 128
"""The most structures (and triggers) a ``structural_tag`` lists."""

BEAM_REFUSES: Final[dict[str, object]] = {
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_new_tokens": 0, "logit_bias": None, "allowed_token_ids": None, "bad_words": None,
    "logprobs": None, "prompt_logprobs": None, "structured_outputs": None,
    "response_format": None, "tools": None, "thinking_token_budget": None,
}  # fmt: skip
"""The fields ``use_beam_search`` does not take, but for their value that changes nothing
(``temperature`` and ``seed`` it takes: each round draws a token, as vLLM's rounds do)."""
GENERATION_FIELDS: Final = (
    "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_new_tokens", "logprobs",
    "stop_token_ids", "n", "logit_bias", "ignore_eos", "min_p",
    "include_stop_str_in_output", "truncate_prompt_tokens", "prompt_logprobs",
    "structured_outputs", "response_format", "tools", "tool_choice", "parallel_tool_calls",
    "allowed_token_ids", "skip_special_tokens", "bad_words", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "return_token_ids", "cache_salt",
    "reasoning_effort", "return_prompt_text", "lora",
    "add_special_tokens", "return_token_strs",
    "use_beam_search", "length_penalty", "thinking_token_budget", "chat_template",
)  # fmt: skip
"""Request fields only generation models take."""


class TextPart(_Strict):
    """One part of a message's content, OpenAI's: ``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One turn of a chat, rendered with the model's chat template."""

    role: str = Field(pattern=r"^[a-z_]{1,32}$")
    """``system``, ``user``, ``assistant``, ``tool`` (or another role the template knows)."""
    content: str | list[TextPart] | None = None
    """The text, or its text parts (the template takes them joined by newlines, or as
    parts: the model's ``chat_template_content_format``); null (or left out) only in an
    assistant turn that made ``tool_calls``."""
    tool_calls: list[PastToolCall] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    """An assistant turn's calls of the request's tools (OpenAI's)."""
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)
    """A ``tool`` turn: the call it answers."""
    name: str | None = Field(None, min_length=1, max_length=64)
    reasoning_content: str | None = Field(
        None, validation_alias=AliasChoices("reasoning_content", "reasoning")
    )
    """An assistant turn's reasoning (a result's ``reasoning_content``; vLLM's, also as
    ``reasoning``): given to the chat template as ``reasoning_content`` (Qwen3's and
    DeepSeek-R1's templates write it back for the turns of a tool-calling loop) and as
    ``thinking`` (gpt-oss's)."""

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message's content is null only when it makes tool_calls")
        return self

    @property
    def chars(self) -> int:
        """Its text's size: the content, the calls' arguments and the reasoning."""
        calls = sum(len(c.function.arguments) for c in self.tool_calls or ())
        text = (
            sum(len(p.text) for p in self.content)
            if isinstance(self.content, list)
            else len(self.content or "")
        )
        return text + calls + len(self.reasoning_content or "")


_ALIASED = ConfigDict(
    extra="forbid", frozen=True, strict=True, validate_by_alias=True, validate_by_name=True,
    serialize_by_alias=True,
)  # fmt: skip


class TagStructure(_Strict):
    """One structure of a :class:`StructuralTag`: ``begin``, JSON valid under ``schema``,
    ``end``."""

    model_config = _ALIASED
    begin: str = Field(min_length=1, max_length=1024)
    """Its opening text; it begins with one of the tag's ``triggers``."""
    json_schema: dict[str, Any] = Field(alias="schema")
    """``schema``: the JSON Schema its JSON is valid under."""
    end: str = Field("", max_length=1024)


class StructuralTag(_Strict):
    """vLLM's structural tag (``structures`` and ``triggers``): the text is free, but where
    it writes a trigger, one of the structures that begin with it follows (its ``begin``,
    JSON valid under its schema, its ``end``), then free text again. Tool calls in a
    model's own format, held mid-text."""

    model_config = _ALIASED
    type: Literal["structural_tag"] = "structural_tag"
    structures: list[TagStructure] = Field(min_length=1, max_length=MAX_STRUCTURES)
    triggers: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        min_length=1, max_length=MAX_STRUCTURES
    )

    @model_validator(mode="after")
    def _triggered(self) -> StructuralTag:
        for s in self.structures:
            if not any(s.begin.startswith(t) for t in self.triggers):
                raise ValueError(f"structural_tag: the structure beginning {s.begin!r} begins "
                                 "with none of its triggers")  # fmt: skip
        size = len(self.model_dump_json(by_alias=True))
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"too_large: structural_tag has {size} chars as JSON "
                             f"> {MAX_GRAMMAR_CHARS}")  # fmt: skip
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: the generated text follows one constraint (exactly one
    of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``, ``structural_tag``)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, validate_by_alias=True, validate_by_name=True,
        serialize_by_alias=True,
    )  # fmt: skip
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    """``json``: a JSON Schema (an object, or its JSON text); the text is JSON valid under it."""
    json_object: bool | None = None
    """True: the text is a JSON object (any)."""
    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    """The text matches this regular expression (Rust ``regex`` syntax, whole text)."""
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    """The text is exactly one of these strings."""
    grammar: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    """The text derives from this context-free grammar: Lark syntax (llguidance's) or GBNF
    (llama.cpp's)."""
    disable_any_whitespace: bool | None = None
    """JSON: no whitespace between tokens (compact JSON); default: any whitespace."""
    disable_additional_properties: bool | None = None
    """JSON: objects hold only the properties their schema lists (as if every object in it
    said ``additionalProperties: false`` where it says nothing)."""
    whitespace_pattern: str | None = Field(None, min_length=1, max_length=256)
    """JSON: the regex whitespace between tokens matches (instead of any whitespace)."""
    structural_tag: StructuralTag | None = None
    """Free text that holds structures where it writes their triggers (vLLM's: an object,
    or its JSON text)."""

    @field_validator("structural_tag", mode="before")
    @classmethod
    def _tag_text(cls, v: Any) -> Any:
        """vLLM's form: the tag as JSON text."""
        if isinstance(v, str):
            if len(v) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"too_large: structural_tag has {len(v)} chars "
                                 f"> {MAX_GRAMMAR_CHARS}")  # fmt: skip
            try:
                return _json.loads(v)
            except ValueError as exc:
                raise ValueError(f"structural_tag: not JSON ({exc})") from None
        return v

    @property
    def kind(self) -> str:
        """Which constraint it sets."""
        return self.set_kinds()[0]

    def set_kinds(self) -> list[str]:
        """The constraint fields it sets (``json_object`` only when true)."""
        kinds = []
        if self.json_schema is not None:
            kinds.append("json")
        if self.json_object:
            kinds.append("json_object")
        kinds += [k for k in ("regex", "choice", "grammar", "structural_tag")
                  if getattr(self, k) is not None]  # fmt: skip
        return kinds

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        kinds = self.set_kinds()
        if len(kinds) != 1:
            raise ValueError("structured_outputs sets exactly one of json, json_object, regex, "
                             f"choice, grammar, structural_tag (it sets {kinds or 'none'})")  # fmt: skip
        if isinstance(self.json_schema, dict):
            size = len(_json.dumps(self.json_schema, separators=(",", ":"), default=str))
        else:
            size = len(self.json_schema or "")
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"too_large: structured_outputs.json has {size} chars as JSON "
                             f"> {MAX_GRAMMAR_CHARS}")  # fmt: skip
        if self.choice is not None:
            chars = sum(len(c) for c in self.choice)
            if chars > MAX_GRAMMAR_CHARS or not all(self.choice):
                raise ValueError(f"structured_outputs.choice: non-empty strings, at most "
                                 f"{MAX_GRAMMAR_CHARS} chars in all")  # fmt: skip
        return self


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, validate_by_alias=True, validate_by_name=True,
        serialize_by_alias=True,
    )  # fmt: skip
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=4096)
    json_schema: dict[str, Any] = Field(alias="schema")
    """``schema``: the JSON Schema the text is valid under."""
    strict: bool | None = None
    """Accepted (OpenAI's); the text always follows the schema."""


class ResponseFormat(_Strict):
    """OpenAI's ``response_format`` (``text``, ``json_object`` or ``json_schema``), and
    vLLM's ``structural_tag`` (with ``structures`` and ``triggers``): the same constraints
    as :class:`StructuredOutputs`' ``json_object``, ``json`` and ``structural_tag``."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: type json_schema comes with json_schema "
                             "(and only it)")  # fmt: skip
        tagged = self.structures is not None and self.triggers is not None
        if (self.type == "structural_tag") != tagged or (
            not tagged and (self.structures or self.triggers) is not None
        ):
            raise ValueError("response_format: type structural_tag comes with structures "
                             "and triggers (and only it)")  # fmt: skip
        if tagged:
            self._tag()  # checked now
        if self.json_schema is not None:
            size = len(
                _json.dumps(self.json_schema.json_schema, separators=(",", ":"), default=str)
            )
            if size > MAX_GRAMMAR_CHARS:
                raise ValueError(f"too_large: response_format.json_schema.schema has {size} "
                                 f"chars as JSON > {MAX_GRAMMAR_CHARS}")  # fmt: skip
        return self

    def structured(self) -> StructuredOutputs | None:
        """The constraint it asks for (None: ``text``, none)."""
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.json_schema is not None:
            return StructuredOutputs.model_validate({"json": self.json_schema.json_schema})
        if self.type == "structural_tag":
            return StructuredOutputs(structural_tag=self._tag())
        return None

    def _tag(self) -> StructuralTag:
        return StructuralTag.model_validate(
            {"structures": self.structures, "triggers": self.triggers}
        )


class Request(_Strict):
    """One inference request: the map stored in a lane stream entry."""

    v: Literal[1] = SCHEMA_VERSION
    id: str = Field(pattern=REQUEST_ID.pattern)
    model: str = Field(pattern=MODEL_NAME.pattern)
    inputs: list[Input] = Field(default_factory=list)
    """Texts, or other kinds of input (schemas/inputs.py): text pairs, rankings, images;
    for a generation model, raw prompts (one output each). A request carries ``inputs`` or
    ``messages``, not both."""
    messages: list[ChatMessage] | None = None
    """Generation models only: one chat (one output), rendered with the chat template."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: more variables for the chat template (``{"enable_thinking": false}`` for
    Qwen3); JSON values, 4,096 chars in all, not the template call's own arguments."""
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)
    """vLLM's: a Jinja chat template that renders this chat in place of the model's
    (sandboxed); only a model with ``trust_request_chat_template`` takes it, others answer
    ``invalid_request``."""
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    """OpenAI's and vLLM's, with ``messages``: how hard a reasoning model thinks, given to
    the chat template as ``reasoning_effort`` (gpt-oss's writes it in its system message;
    a template that does not read it ignores it)."""
    add_generation_prompt: bool | None = None
    """vLLM's: the template opens the assistant's turn (default true)."""
    continue_final_message: bool | None = None
    """vLLM's: the chat's last message (the assistant's) is continued, not closed: the
    text goes on from its content (not with ``add_generation_prompt`` true)."""
    deadline_ms: int | None = Field(None, ge=1, le=7 * 24 * 3600 * 1000)
    """Result due this many ms after the entry was added (its stream id's time)."""
    reply: str | None = Field(None, min_length=1, max_length=256)
    """Pub/sub channel the result is also PUBLISHed to."""
    result_ttl_s: int | None = Field(None, ge=1)
    format: Format | None = None
    """Encoding of the result; default: the encoding the request came in."""
    metadata: dict[str, str] = Field(default_factory=dict)
    """Opaque strings echoed back in the result."""
    webhook: Webhook | None = None
    """POST the result there too (signed, retried); it stays pollable either way."""
    # --- generation models only (an encoder answers invalid_request if any is set) --------
    max_new_tokens: int | None = Field(None, ge=0)
    """Tokens to generate at most per input (default and bound: the model's config). 0:
    none, the prompt only: each output has an empty ``text``, ``finish_reason`` ``length``,
    its ``prompt_tokens`` and, as asked, ``prompt_token_ids``, ``prompt_logprobs`` and
    ``prompt_text`` (a tokenizer's count, a prompt's score); workers before it was allowed
    answer ``invalid_request``."""
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    """0 (the default) is greedy decoding; above 0, sampling."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    """vLLM's and HF's: sample only tokens at least ``min_p`` times as likely as the
    likeliest (after temperature; 0: no limit)."""
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    """Sampling seed: the same request with the same seed gives the same text."""
    stop: list[str] | None = None
    """Generation ends (``finish_reason`` ``stop``) when one of these strings is produced; the
    text is cut before it."""
    stream: bool | None = None
    """Stream tokens as they are produced: to the request's token stream and, as ``delta``
    messages, on its reply channel."""
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    """HF's and vLLM's: a token already in the prompt or output has its logit divided by
    this (multiplied when negative); 1 (the default) is none."""
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    """OpenAI's: subtracted from the logit of every token the output already holds."""
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    """OpenAI's: subtracted from a token's logit once per time the output holds it."""
    min_new_tokens: int | None = Field(None, ge=0)
    """End-of-sequence is not generated before this many tokens (a stop string still ends
    the text); at most ``max_new_tokens``."""
    thinking_token_budget: int | None = Field(None, ge=0)
    """vLLM's: reasoning tokens each output generates at most; then the model's end of
    reasoning (``</think>``) is forced, token by token, and the answer follows (0: it
    ends as soon as it opens). For a model with reasoning markers (its
    ``reasoning_parser``'s tags or ``reasoning_config``), else ``invalid_request``; at
    most the model's ``max_new_tokens`` bound; not with ``use_beam_search``. Workers
    before it was added answer ``invalid_request``."""
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    """vLLM's: generation ends (``finish_reason`` ``stop``) once one of these tokens is
    generated; the token stays in the output (its text too, unless it is a special token)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Each output carries, per generated token, its log-probability under the model and
    the ``logprobs`` likeliest tokens' (0: the chosen token's only); see :class:`Generation`."""
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """vLLM's: each prompt token's log-probability (after the first) and this many
    likeliest tokens at its position, in the first output of each input (padded engine)."""
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    """vLLM's: the prompt shares cached prefixes (and a prefill) only with prompts of the
    same salt, so one tenant cannot time whether another's prompt began as its own did;
    give each tenant a secret random salt (e.g. 43 base64 characters: 256 bits)."""
    lora: str | None = Field(None, min_length=1, max_length=128)
    """The model's LoRA adapter (its ``lora_adapters`` name) this request's text comes from;
    none: the base model. A name the model does not serve is an ``invalid_request``."""
    return_token_ids: bool | None = None
    """vLLM's: each output carries its generated ``token_ids`` (and the first of each
    input its ``prompt_token_ids``), each delta its own ``token_ids``: what an RL trainer
    or a client sending ``prompt_token_ids`` inputs needs, with no tokenizing again."""
    return_prompt_text: bool | None = None
    """The first output of each input carries ``prompt_text``: its prompt as the model
    read it (what OpenAI's ``echo`` and vLLM's ``/detokenize`` show for a prompt sent as
    token ids or a chat); absent otherwise."""
    add_special_tokens: bool | None = None
    """vLLM's: whether the tokenizer adds its special tokens (BOS and the like) when it
    tokenizes a prompt. None: a text with them, a chat without (its template has its
    own); true adds them to a chat's rendered template too, false leaves them off a text.
    ``prompt_token_ids`` inputs are taken as they are. Workers before it was added
    answer ``invalid_request``."""
    return_token_strs: bool | None = None
    """vLLM's ``/tokenize``: the first output of each input carries ``prompt_token_strs``,
    its prompt's tokens as the tokenizer writes them (``convert_ids_to_tokens``). Workers
    before it was added answer ``invalid_request``."""
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    """OpenAI's and vLLM's: added to these tokens' logits (-100 … 100) before sampling. Keys
    are token ids as decimal strings (as in OpenAI's API; Python may pass ints)."""
    ignore_eos: bool | None = None
    """vLLM's: generate past end-of-sequence tokens, up to ``max_new_tokens`` (benchmarks,
    fixed-length outputs); the tokens stay in the output."""
    allowed_token_ids: list[int] | None = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    """vLLM's: only these tokens are generated (an end-of-sequence token only if listed:
    without one, the text runs to ``max_new_tokens``, a stop string or a stop token)."""
    bad_words: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        None, min_length=1, max_length=MAX_BAD_WORDS
    )
    """vLLM's: words never generated (as the tokenizer writes each, alone and after a
    space: the last token of its tokens is not drawn where the text ends with the rest)."""
    skip_special_tokens: bool | None = None
    """vLLM's: false keeps special tokens' text in the output (default true: left out); an
    end-of-sequence token that ends the text shows none either way."""
    include_stop_str_in_output: bool | None = None
    """vLLM's: a text ended by a stop string keeps it (default: cut before it)."""
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=1_000_000)
    """vLLM's: keep only each prompt's last this many tokens (a chat's too, after its
    template): a longer prompt is cut rather than refused."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM's: the text follows a JSON schema, a regex, a list of choices or a grammar."""
    response_format: ResponseFormat | None = None
    """OpenAI's: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}}`` (or ``text``); not with ``structured_outputs``."""
    tools: list[Tool] | None = None
    """OpenAI's: functions the model may call (a chat only; the chat template renders
    them). Each output's ``tool_calls`` holds the calls it made (schemas/tools.py)."""
    tool_choice: ToolChoice | None = None
    """OpenAI's: ``auto`` (the default with tools: calls read out of the free text by the
    model's ``tool_call_parser``), ``required`` (the text is a JSON array of calls),
    ``{"type": "function", "function": {"name": ...}}`` (the text is that function's
    arguments) or ``none``."""
    parallel_tool_calls: bool | None = None
    """OpenAI's: false, at most one call per output (``required``: an array of one;
    ``auto``: the first call read); default true."""
    n: int | None = Field(None, ge=1, le=MAX_COMPLETIONS)
    """Completions per input (OpenAI's and vLLM's ``n``; default 1): the outputs hold ``n``
    per input, input by input (input ``i``'s completion ``j`` is output ``i * n + j``).
    With a ``seed``, completion ``j`` draws from ``seed + j``."""
    # --- beam search (vLLM's extra parameters) ---
    use_beam_search: bool | None = None
    """vLLM's: beam search instead of sampling, ``n`` (default 1) its width; each input's
    outputs are its ``n`` best beams, best first. Ranked by the model's own
    log-probabilities; each beam's round also draws a token at ``temperature`` (seeded by
    ``seed``), a candidate too (vLLM's): it can only end a beam. Not with ``stream`` nor
    the fields that change the logits (see :data:`BEAM_REFUSES`)."""
    length_penalty: float | None = Field(None, ge=-10.0, le=10.0)
    """vLLM's, with ``use_beam_search``: beams are ranked by their cumulative
    log-probability over their length (prompt included) to this power (default 1)."""

    @property
    def input_count(self) -> int:
        """Its inputs: the prompts, or one for a chat."""
        return 1 if self.messages is not None else len(self.inputs)

    @property
    def output_count(self) -> int:
        """How many outputs it gets: one per input, or ``n`` per input."""
        return self.input_count * (self.n or 1)

    @property
    def constraint_set(self) -> bool:
        """It sets ``structured_outputs`` or ``response_format``."""
        return self.structured_outputs is not None or self.response_format is not None

    @property
    def tool_use(self) -> ToolUse | None:
        """How its text holds tool calls (None: no calls are read)."""
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)

    @property
    def constraint(self) -> StructuredOutputs | None:
        """What the text must follow: ``structured_outputs``, ``response_format``'s, or
        the JSON of tool calls that ``tool_choice`` requires (compact)."""
        if self.structured_outputs is not None:
            return self.structured_outputs
        use = self.tool_use
        if use is not None and self.tools:
            schema = calls_schema(self.tools, use)
            if schema is not None:
                return StructuredOutputs.model_validate(
                    {"json": schema, "disable_any_whitespace": True}
                )
        return None if self.response_format is None else self.response_format.structured()

    def _check_template(self) -> None:
        chat = self.messages is not None
        for name in ("chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                     "reasoning_effort", "chat_template"):  # fmt: skip
            if getattr(self, name) is not None and not chat:
                raise ValueError(f"{name} goes with a chat (messages)")
        if self.chat_template_kwargs is not None:
            if reserved := sorted(TEMPLATE_NAMES & set(self.chat_template_kwargs)):
                raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
            if (
                self.reasoning_effort is not None
                and "reasoning_effort" in self.chat_template_kwargs
            ):
                raise ValueError("reasoning_effort is set twice (and in chat_template_kwargs)")
            size = len(_json.dumps(self.chat_template_kwargs, default=str))
            if size > MAX_TEMPLATE_KWARGS_CHARS:
                raise ValueError(f"too_large: chat_template_kwargs take {size} chars as JSON "
                                 f"> {MAX_TEMPLATE_KWARGS_CHARS}")  # fmt: skip
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt are not "
                                 "both true")  # fmt: skip
            assert self.messages is not None
            if self.messages[-1].role != "assistant" or self.messages[-1].content is None:
                raise ValueError("continue_final_message continues a last assistant message "
                                 "with content")  # fmt: skip

    def _check_beam(self) -> None:
        if not self.use_beam_search:
            if self.length_penalty is not None:
                raise ValueError("length_penalty goes with use_beam_search")
            return
        if self.stream:
            raise ValueError("use_beam_search is not streamed: its beams are known only at "
                             "the end (ask without stream)")  # fmt: skip
        if self.max_new_tokens == 0:
            raise ValueError("use_beam_search generates: max_new_tokens at least 1")
        for name, plain in BEAM_REFUSES.items():
            value = getattr(self, name)
            if value is not None and value != plain:
                raise ValueError(f"use_beam_search ranks beams by the model's own "
                                 f"log-probabilities: not with {name}")  # fmt: skip

    def generation_fields(self) -> list[str]:
        """The generation-only fields this request sets."""
        return [f for f in GENERATION_FIELDS if getattr(self, f) is not None]

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_keys(cls, v: Any) -> Any:
        # map keys on the wire are strings (JSON's, and msgpack's here): 50256 -> "50256"
        if isinstance(v, dict):
            return {str(k) if type(k) is int else k: b for k, b in v.items()}
        return v

    @field_validator("v", mode="before")
    @classmethod
    def _int_version(cls, v: Any) -> Any:
        # Literal[1] alone would also take true and 1.0
        if type(v) is not int:
            raise ValueError(f"v must be the integer 1, got {type(v).__name__}")
        return v

    @model_validator(mode="after")
    def _within_limits(self, info: ValidationInfo) -> Request:
        limits: Limits = (info.context or {}).get("limits", DEFAULT_LIMITS)
        if (self.messages is None) == (not self.inputs):
            raise ValueError("a request carries non-empty inputs or messages (one of them)")
        self._generation_within(limits)
        if len(self.inputs) > limits.max_inputs:
            raise ValueError(
                f"too_large: {len(self.inputs)} inputs > max_inputs {limits.max_inputs}"
            )
        if self.n is not None and self.output_count > limits.max_inputs:
            raise ValueError(
                f"too_large: {self.input_count} inputs x n {self.n} = {self.output_count} "
                f"outputs > max_inputs {limits.max_inputs}"
            )
        check_inputs(self.inputs, self.model, limits.max_text_chars, limits.inputs)
        if len(self.metadata) > limits.max_metadata_items:
            raise ValueError(f"too_large: metadata has more than {limits.max_metadata_items} items")
        for k, val in self.metadata.items():
            if len(k) > limits.max_metadata_chars or len(val) > limits.max_metadata_chars:
                raise ValueError(
                    f"too_large: metadata entries are limited to {limits.max_metadata_chars} chars"
                )
        if self.result_ttl_s is not None and self.result_ttl_s > limits.max_result_ttl_s:
            raise ValueError(f"too_large: result_ttl_s > {limits.max_result_ttl_s}")
        return self

    def _generation_within(self, limits: Limits) -> None:
        if self.messages is not None:
            if not self.messages:
                raise ValueError("empty_input: messages is empty")
            if len(self.messages) > limits.max_messages:
                raise ValueError(f"too_large: more than {limits.max_messages} messages")
            chars = sum(m.chars for m in self.messages)
            if chars > limits.max_text_chars:
                raise ValueError(
                    f"too_large: messages have {chars} chars > max_text_chars {limits.max_text_chars}"
                )
        if self.max_new_tokens is not None and self.max_new_tokens > limits.max_new_tokens:
            raise ValueError(
                f"too_large: max_new_tokens {self.max_new_tokens} > {limits.max_new_tokens}"
            )
        if self.min_new_tokens is not None:
            if self.min_new_tokens > limits.max_new_tokens:
                raise ValueError(
                    f"too_large: min_new_tokens {self.min_new_tokens} > {limits.max_new_tokens}"
                )
            if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
                raise ValueError(
                    f"min_new_tokens {self.min_new_tokens} > max_new_tokens {self.max_new_tokens}"
                )
        budget = self.thinking_token_budget
        if budget is not None and budget > limits.max_new_tokens:
            raise ValueError(f"too_large: thinking_token_budget {budget} > {limits.max_new_tokens}")
        if self.stop_token_ids is not None and any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids are token ids: 0 to 2**31 - 1")
        if self.allowed_token_ids is not None and any(
            not 0 <= t < 2**31 for t in self.allowed_token_ids
        ):
            raise ValueError("allowed_token_ids are token ids: 0 to 2**31 - 1")
        if self.logit_bias is not None:
            if any(not (k.isascii() and k.isdigit() and int(k) < 2**31) for k in self.logit_bias):
                raise ValueError("logit_bias keys are token ids: decimal strings, 0 to 2**31 - 1")
            if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
                raise ValueError("logit_bias values are -100 to 100")
        if self.structured_outputs is not None and self.response_format is not None:
            raise ValueError("a request sets structured_outputs or response_format, not both")
        self._check_template()
        self._check_beam()
        check_tools(self.tools, self.tool_choice, self.messages is not None)
        use = self.tool_use
        if use is not None and use.kind != "auto" and self.constraint_set:
            what = "required" if use.kind == "required" else repr(use.name)
            raise ValueError(f"tool_choice {what} constrains the text: not with "
                             "structured_outputs or response_format")  # fmt: skip
        if self.stop is not None:
            if len(self.stop) > limits.max_stop:
                raise ValueError(f"too_large: more than {limits.max_stop} stop strings")
            if any(not s or len(s) > 256 for s in self.stop):
                raise ValueError("stop strings must have 1 to 256 chars")


class ErrorInfo(_Answer):
    """Why a request was not answered ``ok``: a stable ``code`` and a human-readable message."""

    code: ErrorCode | str
    """An :class:`ErrorCode` when this client knows it; a decoded result keeps an unknown code
    as its string (new codes may appear within v1)."""
    message: str

    @field_validator("code", mode="before")
    @classmethod
    def _known_code(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str) and not isinstance(v, ErrorCode):
            if v in ErrorCode._value2member_map_:
                return ErrorCode(v)
            if not cls._from_wire(info):
                raise ValueError(f"unknown error code {v!r}")
        return v

    @field_validator("message")
    @classmethod
    def _short(cls, v: str) -> str:
        return v if len(v) <= 1000 else v[:997] + "..."


class Timings(_Answer):
    """Where a request's time went (milliseconds, Redis server clock)."""

    queued_ms: float = 0.0
    """Enqueue → read by a worker."""
    batch_wait_ms: float = 0.0
    """Read → its batch was dispatched."""
    inference_ms: float = 0.0
    """Its batch's run time on the device."""
    total_ms: float = 0.0
    """Enqueue → result written."""
    batch_size: int = 0
    """Rows in its batch."""
    batch_id: str = ""
    worker: str = ""
    first_token_ms: float | None = None
    """Generation: enqueue → the step that produced its first text (its first delta's;
    a token that is only part of a character waits for the next)."""


class PromptTokensDetails(_Answer):
    """OpenAI's ``usage.prompt_tokens_details``."""

    cached_tokens: int = 0
    """Prompt tokens not prefilled for this request: taken from the worker's prefix cache,
    or from the prefill of the same prompt sent with it (vLLM's ``num_cached_tokens``)."""


class Usage(_Answer):
    """Tokens a request used, over all its inputs: a generation's (a prompt counts once
    whatever its ``n``; every completion's tokens count), or an encoder's input tokens."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Answer):
    """A token and its log-probability at one position."""

    token: int
    """The token id."""
    text: str
    """The token alone, decoded (a piece of a character reads as U+FFFD)."""
    logprob: float


class TokenLogprob(TopLogprob):
    """A generated token, its log-probability, and the likeliest tokens at its position."""

    top: list[TopLogprob] = Field(default_factory=list)
    """The request's ``logprobs`` likeliest tokens, likeliest first."""
    rank: int | None = None
    """The token's rank at its position: 1 + the number of tokens strictly likelier
    (vLLM's); None from workers older than it."""


class Generation(_Answer):
    """A generation model's output for one input (an element of ``Result.outputs``)."""

    text: str
    finish_reason: str
    """``stop`` (end of sequence or a stop string), ``length`` (``max_new_tokens`` or the
    context), ``deadline`` (the request's deadline passed while generating), ``cancelled``;
    readers accept others."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Of ``prompt_tokens``, those its sequence did not prefill: from the prefix cache, or
    the prefill of the same prompt run with it (its request's other completions, or the
    same prompt sent at the same time)."""
    logprobs: list[TokenLogprob] | None = None
    """With the request's ``logprobs``: one per generated token (``completion_tokens`` of
    them, a stop string's and the end-of-sequence token's included), from the model's own
    distribution (before the request's rules, temperature, top-k and top-p); streamed in
    the deltas too."""
    token_ids: list[int] | None = None
    """With the request's ``return_token_ids``: the generated tokens (``completion_tokens``
    of them, as ``logprobs`` counts them); absent otherwise."""
    prompt_token_ids: list[int] | None = None
    """With ``return_token_ids``, in the first output of each input: the prompt's tokens
    (``prompt_tokens`` of them: a chat's rendered template, a truncated prompt's last)."""
    prompt_text: str | None = None
    """With the request's ``return_prompt_text``, in the first output of each input: the
    prompt's text as the model read it: a text input as sent (decoded from its tokens when
    ``truncate_prompt_tokens`` cut it), a chat's rendered template, ``prompt_token_ids``
    decoded (special tokens kept)."""
    prompt_token_strs: list[str] | None = None
    """With the request's ``return_token_strs``, in the first output of each input: the
    prompt's tokens as the tokenizer writes them (``prompt_tokens`` of them; e.g. ``Ġcat``)."""
    stop_reason: str | int | None = None
    """vLLM's: what ended a ``stop`` output: the request's stop string (``stop``) or stop
    token id (``stop_token_ids``) it met; null when an end-of-sequence token ended it, for
    any other ``finish_reason``, and from workers before it was added."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With the request's ``prompt_logprobs``, in the first output of each input: one per
    prompt token (``prompt_tokens`` of them), the first null (nothing precedes it), each
    other the token's log-probability given the tokens before it (vLLM's)."""
    tool_calls: list[ToolCall] | None = None
    """With the request's ``tools``: the calls its text makes (the text is kept as
    generated); absent when it makes none."""
    content: str | None = None
    """With the request's ``tools``, or from a model with a ``reasoning_parser``: the
    answer, the text outside the reasoning and the calls, trimmed (OpenAI's message
    ``content``; empty when the text is only those)."""
    reasoning_content: str | None = None
    """From a model with a ``reasoning_parser``: the text's reasoning (vLLM's), trimmed,
    without its ``<think>`` tags; absent when it has none."""


FINISH_REASONS: Final = ("stop", "length", "deadline", "cancelled")


class Delta(_Answer):
    """Newly generated text of one input, published on the reply channel (``kind`` "delta")
    and appended to the request's token stream while it generates."""

    v: Literal[1] = SCHEMA_VERSION
    kind: Literal["delta"] = "delta"
    id: str
    model: str = ""
    seq: int
    """1, 2, ... per request (over all its inputs): a reader that saw ``seq`` n has all
    deltas up to n."""
    input: int = 0
    """Which output (0-based) the text belongs to: its input's index (with the request's
    ``n``, input ``i``'s completion ``j`` is ``i * n + j``)."""
    text: str
    tokens: int
    """Tokens this delta holds."""
    logprobs: list[TokenLogprob] | None = None
    """With the request's ``logprobs``: one per token this delta holds (see
    :attr:`Generation.logprobs`); absent otherwise."""
    tool_calls: list[ToolCall] | None = None
    """With the request's ``tools``: calls the output's text completed with this delta,
    each streamed once, in order, with the id the result gives it (the result's
    ``tool_calls`` begin with them); absent otherwise."""
    tool_call_chunks: list[ToolCallChunk] | None = None
    """With the request's ``tools``: the calls as they are written, OpenAI's
    ``delta.tool_calls`` (see :class:`ToolCallChunk`): a call's id and name once its name is
    written, then its ``arguments`` piece by piece; a call's pieces add up to the one the
    result holds (same id); ``index`` counts the calls streamed (a call the model began but
    wrote badly, which the result leaves out, keeps its index); absent otherwise."""
    token_ids: list[int] | None = None
    """With the request's ``return_token_ids``: the tokens this delta holds (``tokens``
    of them); absent otherwise."""
    prompt_tokens: int | None = None
    """In the first delta of each output: its prompt's tokens (the result's
    ``prompt_tokens`` for it), so a stream can report its usage as it goes; absent in the
    others, and from workers before it was added."""
    prompt_text: str | None = None
    """With the request's ``return_prompt_text`` and ``stream``, in the first delta of the
    first output of each input (``i * n``): the result's ``prompt_text`` of it, so a stream
    can echo its prompt before the generated text; absent otherwise, and from workers
    before it was added."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With the request's ``prompt_logprobs`` and ``stream``, where ``prompt_text`` would
    be: the result's ``prompt_logprobs`` of that output; absent otherwise, and from workers
    before it was added."""
    prompt_token_ids: list[int] | None = None
    """With the request's ``return_token_ids`` and ``stream``, in the first delta of each
    output (as ``prompt_tokens``): its prompt's tokens (the result's ``prompt_token_ids``
    of its input), so a stream can give each choice its prompt's ids first (vLLM's); absent
    otherwise, and from workers before it was added."""
    content: str | None = None
    """Where the output has a ``content`` (see :attr:`Generation.content`): what this
    delta adds to it (maybe empty); the deltas' pieces add up to the result's ``content``.
    A tool call's markup and the reasoning are not in it; a piece may lag ``text`` (what
    may yet be a call's or the reasoning's start is held back, as is trailing whitespace);
    absent otherwise."""
    reasoning_content: str | None = None
    """From a model with a ``reasoning_parser``: what this delta adds to the output's
    ``reasoning_content`` (maybe empty), the same way; absent otherwise."""


class Result(_Answer):
    """The final answer to one request: stored at its result key and published.

    Workers build it with a known :data:`Status`; clients decode it with
    :func:`~batchfleet.schemas.codec.decode_result`, which keeps any ``status`` string: a
    status this client does not know is a final, non-``ok`` answer.
    """

    v: Literal[1] = SCHEMA_VERSION
    id: str
    model: str
    status: str
    """``ok``, ``error``, ``expired`` (:data:`OK`, :data:`ERROR`, :data:`EXPIRED`), or, decoded
    from a later v1 worker, a status this client does not know."""
    outputs: list[Any] | None = None
    """One output per input (``ok`` only): an embedding list, a classification map, or a
    :class:`Generation` map (``n`` per input with a generation request's ``n``)."""
    truncated: list[bool] | None = None
    """Per input: was it cut to the model's max tokens?"""
    usage: Usage | None = None
    """Tokens used over all inputs: a generation's prompts and completions; an encoder's
    ``prompt_tokens`` only (every row it ran, as cut to its ``max_tokens``)."""
    error: ErrorInfo | None = None
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, str] = Field(default_factory=dict)
    finished_at_ms: int = 0
    """Unix ms (Redis clock) when the result was written."""

    @field_validator("status")
    @classmethod
    def _known_status(cls, v: str, info: ValidationInfo) -> str:
        if v not in KNOWN_STATUSES and not cls._from_wire(info):
            raise ValueError(f"status must be one of {sorted(KNOWN_STATUSES)}, got {v!r}")
        return v

    @property
    def ok(self) -> bool:
        """True for status ``ok`` only (never for a status this client does not know)."""
        return self.status == OK

    def generations(self) -> list[Generation]:
        """A generation model's outputs as :class:`Generation` maps (text, ``finish_reason``,
        token counts), one per input; empty when the result has no outputs."""
        return [
            g
            if isinstance(g, Generation)
            else Generation.model_validate(g, context={FROM_WIRE: True})
            for g in self.outputs or []
        ]
