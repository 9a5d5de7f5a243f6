"""What a worker publishes of the model a runner serves at ``bf:{model}:info``
(:class:`~..schemas.model_info.ModelInfo`): its kind, context and token limits, and for a
generator its sampling defaults, parsers, adapters and options, read off the runner's
attributes. Kept apart from ``runner.py``, the runner seam itself."""

from __future__ import annotations

from typing import Any

from .. import __version__
from ..config import ModelConfig
from ..schemas.messages import Limits
from ..schemas.model_info import ModelInfo
from .runner import Runner, is_continuous


def model_info(
    runner: Runner, limits: Limits, created: int, config: ModelConfig | None = None
) -> ModelInfo:
    """What clients need to know of the model ``runner`` serves, published for gateways: a
    generator's context (``context``, ``max_prompt_tokens``), an encoder's tokens per input
    (``max_tokens``); read off the attributes the built-in runners have, so a custom runner
    with the same ones is described too (one without them: its ``name`` alone). With its
    fleet-file entry ``config``: the version and the serving hash behind a gateway's
    ``system_fingerprint``."""
    task = str(getattr(runner, "name", "") or "custom")[:128]
    served: dict[str, Any] = {"created": created}
    if config is not None:
        served |= {"version": __version__, "config_hash": config.serving_hash(__version__)}
    if not is_continuous(runner):
        tokens = getattr(runner, "max_tokens", None)
        return ModelInfo(task=task, max_model_len=_positive(tokens), **served)
    template = getattr(getattr(runner, "tokenizer", None), "chat_template", None)
    return ModelInfo(
        task=task,
        max_model_len=_positive(getattr(runner, "context", None)),
        max_prompt_tokens=_positive(getattr(runner, "max_prompt_tokens", None)),
        max_new_tokens=limits.max_new_tokens,
        default_max_new_tokens=_positive(getattr(runner, "default_new_tokens", None)),
        chat_template=bool(template),
        sampling_defaults=_sampling(getattr(runner, "sampling_defaults", None)),
        tool_call_parser=_text(getattr(runner, "tool_call_parser", None)),
        reasoning_parser=_text(getattr(runner, "reasoning_parser", None)),
        lora_adapters=_names(getattr(runner, "lora_adapters", None)),
        beam_search=getattr(runner, "beam_search", None) is True or None,
        content_parts=True,
        thinking_token_budget=_flag(getattr(runner, "thinking_budget", None)),
        trust_request_chat_template=_flag(
            getattr(getattr(runner, "templates", None), "trust_request", None)
        ),
        **served,
    )


def _sampling(defaults: object) -> dict[str, float | int]:
    """A runner's sampling defaults (:class:`.generation.defaults.SamplingDefaults`'s)."""
    values = getattr(defaults, "sampling", None)
    return dict(values) if isinstance(values, dict) else {}


def _flag(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _names(value: object) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, tuple | list) else []
