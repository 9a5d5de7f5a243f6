"""What a client needs to know of a model, as its workers publish it at ``bf:{model}:info``:
the kind of model and how long its inputs may be (vLLM's ``max_model_len``)."""

from __future__ import annotations

from pydantic import Field

from .wire import FROM_WIRE, _Answer


class ModelInfo(_Answer):
    """Written as JSON by each worker of the model when it starts (the last one's stands);
    decoded by :func:`decode_model_info`, which ignores fields it does not know, so a later
    worker may add some within v1."""

    task: str = Field(min_length=1, max_length=128)
    """The runner serving it, as the fleet file names it: ``text-generation``,
    ``embedding``, ``text-classification``, ``rerank``... (a custom runner's ``name``)."""
    max_model_len: int | None = Field(None, ge=1)
    """A generating model: the longest sequence it serves, prompt and generated tokens
    together; an encoder: the most tokens of one input (longer ones are cut). None: the
    model takes no text (an image classifier) or its runner does not tell."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """A generating model: the longest prompt it takes (a longer one is ``too_large``)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """A generating model: the most tokens a request may ask for (``limits.max_new_tokens``;
    the context left after the prompt cuts it further)."""
    default_max_new_tokens: int | None = Field(None, ge=0)
    """A generating model: what a request that sets no ``max_new_tokens`` generates at most."""
    sampling_defaults: dict[str, float | int] = Field(default_factory=dict)
    """A generating model: what a request that leaves ``temperature``, ``top_p``,
    ``top_k``, ``min_p`` or ``repetition_penalty`` unset samples with (the model's
    ``generation_config`` and ``override_generation_config`` options, vLLM's names); a
    field not here has the protocol's default (``temperature`` 0: greedy)."""
    chat_template: bool | None = None
    """A generating model: its tokenizer has a chat template (else chat requests are refused)."""
    tool_call_parser: str | None = None
    """How tool calls are read out of its text (the runner option; None: none)."""
    reasoning_parser: str | None = None
    """How reasoning is split from the answer (the runner option; None: none)."""
    thinking_token_budget: bool | None = None
    """A generating model: its workers take a ``thinking_token_budget`` (True: it has
    reasoning markers, the ``reasoning_config`` option's or its reasoning parser's tags);
    False: they refuse one (``invalid_request``), as a gateway then does before submitting;
    None: workers before it (their own check tells)."""
    trust_request_chat_template: bool | None = None
    """A generating model: its workers render a request's own ``chat_template`` (its
    ``trust_request_chat_template`` option); False: they refuse one (``invalid_request``),
    as a gateway then does before submitting; None: workers before it (their own check
    tells)."""
    lora_adapters: list[str] = Field(default_factory=list)
    """A generating model: the LoRA adapters a request may name in its ``lora`` (the
    runner's ``lora_adapters`` option; empty: none)."""
    beam_search: bool | None = None
    """A generating model: its workers take ``use_beam_search`` (None: workers before it,
    which refuse the field as ``invalid_request``)."""
    content_parts: bool | None = None
    """A generating model: its workers take a chat message's ``content`` as a list of text
    parts (and join them or not as its ``chat_template_content_format`` says). None: workers
    before it, which take text only: a gateway joins the parts by newlines for them."""
    version: str | None = Field(None, max_length=64)
    """The batchfleet version of the worker that published it (None: workers before it)."""
    config_hash: str | None = Field(None, pattern=r"^[0-9a-f]{8,64}$")
    """SHA-256 (hex) of the worker's serving configuration of the model (its version, and
    its fleet-file entry's runner, weights, device, dtype and runner options: what decides
    answers, not how they are scheduled): a gateway's ``system_fingerprint`` (vLLM's
    ``--fingerprint-mode full`` and ``hash``). None: workers before it."""
    created: int = Field(0, ge=0)
    """Unix seconds when a worker first published the model's info (kept by later ones)."""


def decode_model_info(data: bytes | str) -> ModelInfo:
    """Read a published ``ModelInfo`` as a tolerant reader (unknown fields ignored); raises
    ``pydantic.ValidationError`` for one that is not JSON or lacks ``task``."""
    return ModelInfo.model_validate_json(data, context={FROM_WIRE: True})


class WorkerServing(_Answer):
    """What one worker serves a model with, as it publishes it with each heartbeat in
    ``bf:{model}:serving`` (consumer name → JSON): workers of one model may run different
    fleet-file entries, so the gateway's fingerprint and the control commands' wait read
    each live worker's own rather than the last one started's."""

    version: str | None = Field(None, max_length=64)
    """Its batchfleet version."""
    config_hash: str | None = Field(None, pattern=r"^[0-9a-f]{8,64}$")
    """Its serving hash of the model (as :attr:`ModelInfo.config_hash`)."""
    heartbeat_timeout_ms: int | None = Field(None, ge=1)
    """Its fleet file's ``heartbeat_timeout_ms``: how long a silence of its heartbeat
    means it is dead."""


def decode_worker_serving(data: bytes | str) -> WorkerServing | None:
    """Read one worker's ``WorkerServing`` tolerantly; None for one that is not ours to read."""
    try:
        return WorkerServing.model_validate_json(data, context={FROM_WIRE: True})
    except ValueError:  # pydantic's ValidationError is one
        return None
