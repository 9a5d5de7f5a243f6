"""The request: the map a producer adds to a lane stream and a worker reads, with its
webhook; its parts live in :mod:`.chat`, :mod:`.structured`, :mod:`.tools` and
:mod:`.inputs`, its bounds in :mod:`.limits` and :mod:`.generation_fields`."""

from __future__ import annotations

import json as _json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .chat import MAX_CHAT_TEMPLATE_CHARS, MAX_TEMPLATE_KWARGS_CHARS, TEMPLATE_NAMES, ChatMessage
from .generation_fields import (
    BEAM_REFUSES,
    GENERATION_FIELDS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_COMPLETIONS,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)
from .inputs import Input, check_inputs
from .keys import MODEL_NAME, REQUEST_ID
from .limits import DEFAULT_LIMITS, Limits
from .structured import ResponseFormat, StructuredOutputs
from .tools import Tool, ToolChoice, ToolUse, calls_schema, check_tools, tool_use
from .version import SCHEMA_VERSION, Format
from .wire import _Strict

SECRET_ID = r"^[A-Za-z0-9_.-]{1,64}$"


class Webhook(_Strict):
    """Where to POST a request's result. Secrets live in the fleet file, never in a request."""

    url: str = Field(min_length=8, max_length=2048, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^\s]+$")
    """``https://`` (``http://`` only where the fleet allows it); checked again on delivery."""
    secret_id: str | None = Field(None, pattern=SECRET_ID)
    """Which configured secret signs the delivery; default: the fleet's."""
    format: Format | None = None
    """Body encoding; default ``json``."""


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
