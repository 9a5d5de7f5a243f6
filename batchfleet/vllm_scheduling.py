"""vLLM's flags of capacity and scheduling as fleet settings: speculative decoding (its
JSON and the ``--spec-*`` flags), the sequences running and the requests waiting, the KV
cache's blocks, planning ahead, the device, and shutting down."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .vllm_args import Flag
from .vllm_conversion import Conversion, Line, count

SPEC_KEYS = {"--spec-method": "method", "--spec-model": "model",
             "--spec-tokens": "num_speculative_tokens"}  # fmt: skip
"""vLLM's short speculative flags and the ``--speculative-config`` key each sets."""


def _speculative_config(flag: Flag, out: Conversion) -> None:
    """The JSON's keys (a null is vLLM's default: the key left out, as TOML has no null)."""
    raw = json.loads(flag.value)
    if not isinstance(raw, dict):
        raise ValueError("a JSON object")
    out.option(flag, "speculative",
               {str(k).replace("-", "_"): v for k, v in raw.items() if v is not None})  # fmt: skip


def _spec_key(flag: Flag, out: Conversion) -> None:
    """One key of the speculative table, as vLLM adds it to ``--speculative-config``'s
    (where that sets it too, vLLM refuses both)."""
    key = SPEC_KEYS[flag.name]
    given = out.setting("speculative")
    raw: dict[str, Any] = dict(given.value) if given else {}
    if key in raw and given is not None and given.source.startswith("--speculative-config"):
        raise ValueError(f"--speculative-config sets {key} too: give one")
    raw[key] = count(flag.value) if key == "num_speculative_tokens" else flag.value
    source = f"{given.source}, {flag.shown()}" if given else flag.shown()
    out.options = [ln for ln in out.options if ln.key != "speculative"]
    out.options.append(Line("speculative", raw, source))


def speculative(out: Conversion) -> None:
    """The speculative table the flags made, checked as the runner checks it (a
    ``ValueError`` names the flags and what the fleet does not take)."""
    given = out.setting("speculative")
    if given is None:
        return
    from .worker.generation.speculative import parse

    try:
        parse(given.value)
    except ValueError as exc:
        raise ValueError(f"{given.source}: {exc}") from None


def _schedule_ahead_off(flag: Flag, out: Conversion) -> None:
    out.option(flag, "schedule_ahead", False)


def _active_seqs(flag: Flag, out: Conversion) -> None:
    """vLLM's bound on the sequences running, under ``--max-num-seqs`` (which sizes its
    buffers): the fleet's ``max_running``."""
    out.option(flag, "max_running", count(flag.value))


def _queued_requests(flag: Flag, out: Conversion) -> None:
    out.model.append(Line("max_queue_depth", count(flag.value), f"{flag.shown()}: per lane, "
                          "requests past it are refused (429 queue_full; vLLM's 503 counts "
                          "waiting and running requests of one server)"))  # fmt: skip


def _gpu_blocks(flag: Flag, out: Conversion) -> None:
    """vLLM's KV-cache blocks as tokens, where ``--block-size`` says a block's tokens."""
    blocks = count(flag.value)
    size = out.setting("page_size")
    if size is None:
        out.judged(flag, False, "the KV cache is sized in tokens: without --block-size "
                   "(vLLM's is its attention backend's) set kv_cache_tokens to blocks x "
                   "block size")  # fmt: skip
        return
    out.option(flag, "kv_cache_tokens", blocks * int(size.value))


def _device_ids(flag: Flag, out: Conversion) -> None:
    """One device, by its number: the model's ``device``."""
    ids = [part.strip() for part in flag.value.split(",")]
    if len(ids) == 1 and ids[0].isdigit():
        out.model.append(Line("device", f"cuda:{ids[0]}", f"{flag.shown()}: numbered as "
                              "CUDA numbers them (within CUDA_VISIBLE_DEVICES where set)"))  # fmt: skip
    else:
        out.judged(flag, False, "a worker serves a model on one device, named by its "
                   "number: give each worker's fleet file its device (cuda:N)")  # fmt: skip


def _shutdown_timeout(flag: Flag, out: Conversion) -> None:
    """vLLM's wait for the requests in flight on shutdown: the gateway's ``--grace`` and
    the workers' ``shutdown_grace_s``."""
    seconds = int(flag.value)
    if seconds < 0:
        raise ValueError(f"{seconds} is not 0 or more seconds")
    if seconds == 0:
        out.judged(flag, True, "vLLM aborts the requests in flight at once; here they get "
                   "the fleet's grace (30 s), and a stopping worker's are generated again "
                   "by another")  # fmt: skip
        return
    out.gateway.append(("--grace", str(seconds)))
    out.worker.append(Line("shutdown_grace_s", seconds, f"{flag.shown()}: running "
                           "generations get this long, then go back to the fleet"))  # fmt: skip


SCHEDULING: dict[str, Callable[[Flag, Conversion], None]] = {
    "--speculative-config": _speculative_config, **dict.fromkeys(SPEC_KEYS, _spec_key),
    "--no-async-scheduling": _schedule_ahead_off, "--max-num-active-seqs": _active_seqs,
    "--max-num-queued-reqs": _queued_requests, "--num-gpu-blocks-override": _gpu_blocks,
    "--device-ids": _device_ids, "--shutdown-timeout": _shutdown_timeout,
}  # fmt: skip
"""These flags and how each becomes a setting."""
