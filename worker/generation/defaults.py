"""A model's sampling defaults: vLLM's ``--generation-config`` and
``--override-generation-config`` (``ModelConfig.get_diff_sampling_param``).

The fields a request leaves unset (None) take the model's defaults: those of its
``generation_config.json`` (``generation_config = "auto"``, or a folder holding one), then
the operator's ``override_generation_config`` over them. vLLM takes six keys of the file,
whatever its ``do_sample`` says (a file with ``do_sample: false`` and ``temperature: 0.6``
samples at 0.6 in vLLM, and here); ``max_new_tokens`` is the default of a request's own,
and a bound on every request's (:attr:`SamplingDefaults.cap`) where vLLM's serving layer
makes it one (its ``override_max_tokens``): the override's, or a folder's file's (the
override's over it); ``auto``'s file's is a default only (vLLM #34063).
Beam search takes only ``temperature`` and ``max_new_tokens`` of them, as vLLM's
``to_beam_search_params`` does: the others it does not take are not applied to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pydantic import ConfigDict, ValidationError, create_model

from ...schemas.messages import Request

logger = logging.getLogger(__name__)

KEYS: Final = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
"""The keys vLLM takes from a generation config (its ``available_params``)."""
BEAM_KEYS: Final = frozenset({"temperature", "max_new_tokens"})
"""Those that beam search takes (vLLM's ``to_beam_search_params``)."""
SOURCES: Final = ("auto", "vllm")
"""``generation_config``'s words; anything else is a folder holding a generation config."""

_Values = create_model(  # the request fields' own types and bounds
    "_Values",
    __config__=ConfigDict(extra="forbid", strict=False),
    **{k: (Request.model_fields[k].annotation, Request.model_fields[k]) for k in KEYS},  # type: ignore[call-overload]
)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The defaults applied to a model's requests (``values``: vLLM's names, set ones only)."""

    values: dict[str, float | int]
    overridden: frozenset[str] = frozenset()
    """The keys the operator's ``override_generation_config`` set."""
    cap: int | None = None
    """The most tokens any request generates, its own ``max_new_tokens`` cut to it (vLLM's
    ``override_max_tokens`` in ``get_max_tokens``); None: no such bound."""

    def apply(self, req: Request) -> Request:
        """``req`` with its unset fields set to the defaults (beam search: those it takes);
        explicit values, ``temperature`` 0 included, stay. Validators do not run again: a
        default never trips a beam-search refusal meant for a request's own fields."""
        beam = bool(req.use_beam_search)
        update = {k: v for k, v in self.values.items()
                  if k != "max_new_tokens" and getattr(req, k) is None
                  and (not beam or k in BEAM_KEYS)}  # fmt: skip
        return req.model_copy(update=update) if update else req

    @property
    def sampling(self) -> dict[str, float | int]:
        """The sampling defaults (``max_new_tokens`` apart: the runner's default length)."""
        return {k: v for k, v in self.values.items() if k != "max_new_tokens"}

    @property
    def max_new_tokens(self) -> int | None:
        value = self.values.get("max_new_tokens")
        return None if value is None else int(value)


def checked(raw: Any, where: str) -> dict[str, float | int]:
    """``raw`` (a mapping of vLLM's keys) validated with the request fields' bounds; a
    ``ValueError`` naming ``where``, an unknown key (with the keys taken) or a bad value."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a table of {', '.join(KEYS)}, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: {', '.join(map(str, unknown))} not taken (vLLM's keys: "
                         f"{', '.join(KEYS)})")  # fmt: skip
    if raw.get("top_k") == -1:  # vLLM's "no limit" too (the protocol's 0)
        raw = raw | {"top_k": 0}
    try:
        values = _Values.model_validate(raw).model_dump(exclude_none=True)
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{where}: {bad}") from None
    if values.get("max_new_tokens") == 0:
        raise ValueError(f"{where}: max_new_tokens at least 1")
    return values


def file_values(folder: str | Path) -> dict[str, float | int]:
    """The sampling keys a folder's (or hub id's) ``generation_config.json`` sets, as
    vLLM's ``try_get_generation_config`` reads them (none: no file there)."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(str(folder))
    except OSError:  # no generation_config.json there (vLLM: the model config's, none)
        return {}
    diff = config.to_diff_dict()
    return checked({k: diff[k] for k in KEYS if diff.get(k) is not None},
                   f"{folder}/generation_config.json")  # fmt: skip


def load(path: str | Path, source: Any = "vllm", override: Any = None,
         gguf_file: str | None = None) -> SamplingDefaults:  # fmt: skip
    """A model's defaults: ``source`` (``options.generation_config``) ``vllm``: none (the
    wire protocol's: greedy); ``auto``: the model's file (a GGUF file's: none, as vLLM
    reads none from one); a folder: its file. ``override``
    (``options.override_generation_config``) over them. A ``ValueError`` for bad options."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"options.generation_config: {source!r} is not 'auto', 'vllm' or a "
                         "folder holding a generation_config.json")  # fmt: skip
    values: dict[str, float | int] = {}
    if source == "auto" and gguf_file is None:
        values = file_values(path)
    elif source not in SOURCES:
        folder = Path(source).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"options.generation_config: {source} holds no "
                             "generation_config.json")  # fmt: skip
        values = file_values(folder)
    given = {} if override is None else checked(override, "options.override_generation_config")
    values |= given
    if values:
        logger.info("sampling defaults for requests that set none: %s (generation_config %s)",
                    values, source)  # fmt: skip
    # vLLM: a folder's max_new_tokens bounds every request, auto's (and none's) only the
    # override's does: the file's is the default of a request that sets none
    capped = values if source not in SOURCES else given
    cap = capped.get("max_new_tokens")
    return SamplingDefaults(values, frozenset(given), None if cap is None else int(cap))
