"""Remote control through Celery's own mechanism: pause, resume, drain, live batch policy,
LoRA adapters loaded and unloaded while the model serves, the prefix cache emptied.

``celery -A batchfleet.worker.app control bf_pause tiny`` (or ``batchfleet pause tiny``)
reaches every worker that serves ``tiny``; leave the model out to act on all of a worker's
models. ``inspect bf_state`` shows each loop's state and policy. Commands find the batch
loops through the worker (``state.consumer.controller``); Flower cannot call them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import redis
from celery.worker.control import control_command, inspect_command
from pydantic import ValidationError

from ..batching.gen_types import GenPolicy
from ..config import BatchConfig, FleetConfig
from ..remote import parse_settings
from .observers import Answered, Generated, LoopEvent, LoopObserver
from .runner import Runner
from .runner_info import model_info

if TYPE_CHECKING:
    from .loop import BatchLoop
    from .streams import ModelStreams

logger = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0


class RecentRate:
    """Answered requests (and generated tokens) over the last minute, for ``inspect stats``
    and ``batchfleet top``."""

    def __init__(
        self, window_s: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int, int, int]] = deque()
        """(when, answered, errors, expired)"""
        self._tokens: deque[tuple[float, int]] = deque()
        """(when, tokens generated): one per second at most"""
        self._generating = False
        self._lock = threading.Lock()
        self._since = clock()

    def notify(self, event: LoopEvent) -> None:
        if isinstance(event, Generated):
            self._generated(event.tokens)
            return
        if not isinstance(event, Answered):
            return
        errors = sum(a.result.status == "error" for a in event.replies)
        expired = sum(a.result.status == "expired" for a in event.replies)
        now = self._clock()
        with self._lock:
            self._events.append((now, len(event.replies), errors, expired))
            self._prune(now)

    def _generated(self, tokens: int) -> None:
        """A step's tokens, added to this second's count (a step per few ms would otherwise
        keep thousands of entries)."""
        now = self._clock()
        with self._lock:
            self._generating = True
            if self._tokens and now - self._tokens[-1][0] < 1.0:
                at, n = self._tokens[-1]
                self._tokens[-1] = (at, n + tokens)
            elif tokens:
                self._tokens.append((now, tokens))
                self._prune(now)

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self._events and self._events[0][0] < horizon:
            self._events.popleft()
        while self._tokens and self._tokens[0][0] < horizon:
            self._tokens.popleft()

    def snapshot(self) -> dict[str, float]:
        now = self._clock()
        with self._lock:
            self._prune(now)
            total = sum(e[1] for e in self._events)
            errors = sum(e[2] for e in self._events)
            expired = sum(e[3] for e in self._events)
            tokens = sum(n for _, n in self._tokens)
            generating = self._generating
        span = max(1e-3, min(self.window_s, now - self._since))
        out = {
            "requests_per_s": round(total / span, 2),
            "error_ratio": round(errors / total, 4) if total else 0.0,
            "expired_ratio": round(expired / total, 4) if total else 0.0,
        }
        if generating:
            out["tokens_per_s"] = round(tokens / span, 1)
        return out


def recent_rate(worker: Any, fleet: FleetConfig, model: str) -> LoopObserver:
    """Observer factory for ``app.batchfleet_observers``."""
    return RecentRate()


def loop_info(loop: BatchLoop) -> dict[str, Any]:
    """What ``inspect stats`` and Flower's worker page show besides the counters: state,
    the live batch policy, queue depths and pending counts per lane (read from Redis now)."""
    policy = loop.engine.policy
    info: dict[str, Any] = {
        "consumer": loop.consumer,
        "state": loop.state,
        "held": loop.held,
        "runner": loop.runner.info(),
        "policy": {
            "max_batch_size": policy.max_batch_size,
            "max_wait_ms": policy.max_wait_ms,
            "max_batch_tokens": policy.max_batch_tokens,
            "preferred_batch_sizes": list(policy.preferred_batch_sizes),
            "lane_weights": list(policy.lane_weights),
            "max_starvation_ms": policy.max_starvation_ms,
            "adaptive": policy.adaptive,
        },
    }
    budgets = loop.budgets  # a generating model: these are what its steps follow
    if budgets is not None:
        info["policy"] = {
            "max_running": budgets.max_running,
            "step_tokens": budgets.step_tokens,
            "kv_cache_tokens": budgets.kv_cache_tokens,
            "page_size": budgets.page_size,
            "lane_weights": list(budgets.lane_weights),
            "max_starvation_ms": budgets.max_starvation_ms,
        }
    rate = next((o for o in loop.observers.observers if isinstance(o, RecentRate)), None)
    if rate is not None:
        info.update(rate.snapshot())
    if loop.streams is not None:
        try:
            depth, pending = loop.streams.depths()
            info["depth"] = {str(i): n for i, n in enumerate(depth)}
            info["pending"] = {str(i): n for i, n in enumerate(pending)}
        except redis.RedisError as exc:
            info["redis_error"] = str(exc)
    return info


def summary_line(info: dict[str, Any]) -> str:
    """One line of a loop's ``inspect stats`` entry, for Flower's worker page."""
    requests = ", ".join(f"{k} {v}" for k, v in sorted(info.get("requests", {}).items())) or "none"
    depth = "/".join(str(v) for _, v in sorted(info.get("depth", {}).items()))
    pending = "/".join(str(v) for _, v in sorted(info.get("pending", {}).items()))
    policy = info.get("policy", {})
    return (
        f"{info.get('state', '?')} | {info.get('requests_per_s', 0.0)} req/s{_tokens(info)}, "
        "error ratio "
        f"{info.get('error_ratio', 0.0)}, expired ratio {info.get('expired_ratio', 0.0)} | answered: {requests} | {info.get('batches', 0)} batches, "
        f"mean {info.get('mean_batch_rows', 0.0)} rows, padding waste "
        f"{info.get('padding_waste', 0.0):.0%} | held {info.get('held', 0)}, lane depth {depth or '-'}, "
        f"pending {pending or '-'} | {_policy_line(policy)}"
    )


def _tokens(info: dict[str, Any]) -> str:
    """A generating model's tokens/s, for the summary line."""
    rate = info.get("tokens_per_s")
    return "" if rate is None else f", {rate} tokens/s"


def _policy_line(policy: dict[str, Any]) -> str:
    if "max_running" in policy:  # a generating model
        return (
            f"max running {policy.get('max_running')}, step tokens {policy.get('step_tokens')}, "
            f"KV cache {policy.get('kv_cache_tokens')} tokens"
        )
    return (
        f"max batch {policy.get('max_batch_size')}, max wait {policy.get('max_wait_ms')} ms, "
        f"adaptive {policy.get('adaptive')}"
    )


def _loops(state: Any, model: str | None) -> list[BatchLoop]:
    worker = state.consumer.controller
    loops = [lp for step in worker.steps for lp in getattr(step, "loops", ())]
    return [lp for lp in loops if model in (None, "", lp.model)]


def _elsewhere(state: Any, model: str | None) -> dict[str, Any]:
    """The reply of a worker that does not serve ``model`` (not an error: a broadcast
    reaches every worker), with its consumer name where it has one: who replied."""
    reply: dict[str, Any] = {"ok": f"no loop for {model!r} here", "models": []}
    return reply | _me(_loops(state, None))


def _me(loops: Sequence[BatchLoop]) -> dict[str, Any]:
    """Who replies: its consumer name (the heartbeats'), not always its Celery hostname."""
    return {"consumer": loops[0].consumer} if loops else {}


def _act(state: Any, model: str | None, what: str) -> dict[str, Any]:
    loops = _loops(state, model)
    if not loops:
        return _elsewhere(state, model)
    for lp in loops:
        getattr(lp, what)()
        logger.info("control: %s %s", what, lp.model)
    return {"ok": what, "models": [lp.model for lp in loops], "consumer": loops[0].consumer}


@control_command(args=[("model", str)], signature="[model]")
def bf_pause(state: Any, model: str | None = None) -> dict[str, Any]:
    """Stop reading new requests (all models, or one); held ones are still answered."""
    return _act(state, model, "pause")


@control_command(args=[("model", str)], signature="[model]")
def bf_resume(state: Any, model: str | None = None) -> dict[str, Any]:
    """Resume reading after bf_pause."""
    return _act(state, model, "resume")


@control_command(args=[("model", str)], signature="[model]")
def bf_drain(state: Any, model: str | None = None) -> dict[str, Any]:
    """Stop reading, answer what is held, stop the loop; when no loop is left, the worker
    shuts down (warm shutdown), so it can be removed without losing a request."""
    reply = _act(state, model, "drain")
    all_loops = _loops(state, None)
    threading.Thread(
        target=_exit_when_stopped, args=(all_loops,), name="bf-drain", daemon=True
    ).start()
    return reply


def _exit_when_stopped(loops: list[BatchLoop]) -> None:
    for lp in loops:
        if not lp.draining:
            return  # other models keep serving
    for lp in loops:
        lp.wait_stopped()
    logger.info("drained: all batch loops stopped, shutting the worker down")
    os.kill(os.getpid(), signal.SIGTERM)


GENERATION_KNOBS = ("max_running", "step_tokens", "lane_weights", "max_starvation_ms")
"""What ``bf_policy`` changes live for a generating model. The KV cache (``kv_cache_tokens``,
``page_size``) is allocated once; ``max_running`` and ``step_tokens`` go no higher than
the fleet file's values (the engine and its memory were sized for those)."""


def generation_budgets(
    current: GenPolicy, configured: GenPolicy, changes: dict[str, Any]
) -> GenPolicy:
    """A generating model's budgets with ``changes`` applied; ValueError if one is not a
    live knob or out of bounds."""
    unknown = sorted(set(changes) - set(GENERATION_KNOBS))
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: not a live setting of a generating model "
            f"(those are {', '.join(GENERATION_KNOBS)})"
        )
    update: dict[str, Any] = {}
    for key in ("max_running", "step_tokens"):
        if key in changes:
            value = changes[key]
            ceiling = getattr(configured, key)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= ceiling:
                raise ValueError(f"{key} must be an integer from 1 to {ceiling} (the fleet file's)")
            update[key] = value
    if "lane_weights" in changes:
        weights = changes["lane_weights"]
        if (
            not isinstance(weights, list)
            or len(weights) != current.lanes
            or not all(isinstance(w, int | float) and w > 0 for w in weights)
        ):
            raise ValueError(f"lane_weights needs {current.lanes} positive numbers")
        update["lane_weights"] = tuple(float(w) for w in weights)
    if "max_starvation_ms" in changes:
        ms = changes["max_starvation_ms"]
        if not isinstance(ms, int | float) or isinstance(ms, bool):
            raise ValueError("max_starvation_ms must be a number")
        update["max_starvation_ms"] = float(ms)
    return replace(current, **update)  # GenPolicy checks the rest (step_tokens > max_running)


@control_command(args=[("model", str)], variadic="settings", signature="model key=value ...")
def bf_policy(state: Any, model: str, settings: Sequence[str] = ()) -> dict[str, Any]:
    """Change batch policy knobs live (max_batch_size, max_wait_ms, max_batch_tokens,
    lane_weights, preferred_batch_sizes, max_starvation_ms, adaptive); for a generating
    model, its budgets (:data:`GENERATION_KNOBS`)."""
    loops = _loops(state, model)
    if not loops:
        return _elsewhere(state, model)
    me = _me(loops)
    try:
        changes = parse_settings([s for s in settings if s != model])
    except ValueError as exc:
        return {"error": str(exc), **me}
    for lp in loops:
        if lp.budgets is not None and lp.configured_budgets is not None:
            try:
                budgets = generation_budgets(lp.budgets, lp.configured_budgets, changes)
            except ValueError as exc:
                return {"error": f"{lp.model}: {exc}", **me}
            lp.set_policy(budgets)
            logger.info("control: budgets of %s changed: %s", lp.model, changes)
            continue
        try:
            batch = BatchConfig.model_validate({**lp.config.batch.model_dump(), **changes})
            policy = batch.policy(lp.config.lanes)
        except (ValidationError, ValueError) as exc:
            return {"error": f"{lp.model}: {exc}", **me}
        lp.config = lp.config.model_copy(update={"batch": batch})
        lp.set_policy(policy)
        logger.info("control: policy of %s changed: %s", lp.model, changes)
    return {"ok": "policy", "models": [lp.model for lp in loops], "changes": changes, **me}


@control_command(args=[("model", str), ("name", str), ("path", str)],
                 signature="model name path")  # fmt: skip
def bf_load_lora(state: Any, model: str, name: str, path: str) -> dict[str, Any]:
    """Load a PEFT LoRA adapter (a directory this worker reads) for a generating model,
    under ``name``: read and checked here as at startup (refused: the reply says why, and
    nothing changes), served from the next step on; the model's info is published again.
    vLLM's ``/v1/load_lora_adapter``. Each worker answers for itself, and records the
    adapter (its directory made absolute here) in ``bf:{model}:lora``: a worker started
    later loads it too (:func:`restore_loras`). A refusal's ``code``: ``already_loaded``,
    or ``refused`` (anything else)."""
    # as typed, a relative path would be read from each worker's own directory
    return _lora(state, model, "load_lora", name, os.path.abspath(os.path.expanduser(path)))


@control_command(args=[("model", str), ("name", str)], signature="model name")
def bf_unload_lora(state: Any, model: str, name: str) -> dict[str, Any]:
    """Unload a LoRA adapter: a new request naming it is an ``invalid_request``; those that
    started under it end under it (vLLM's ``/v1/unload_lora_adapter``); a worker started
    later does not serve it, even from its fleet file (``bf:{model}:lora`` records it
    unloaded). A refusal's ``code``: ``not_loaded``, or ``refused``."""
    return _lora(state, model, "unload_lora", name)


def _lora(state: Any, model: str, what: str, *args: str) -> dict[str, Any]:
    if not model:
        return {"error": "name the model", **_me(_loops(state, None))}
    loops = _loops(state, model)
    if not loops:
        return _elsewhere(state, model)
    reply: dict[str, Any] = {"ok": "", "models": [], "lora_adapters": {},
                             "consumer": loops[0].consumer}  # fmt: skip
    if what == "load_lora":
        reply["path"] = args[1]
    for lp in loops:
        act = getattr(lp.runner, what, None)
        if act is None:
            return {"error": f"{lp.model}: its runner serves no LoRA adapters",
                    "consumer": lp.consumer}  # fmt: skip
        try:
            act(*args)
        except ValueError as exc:
            return {"error": f"{lp.model}: {exc}", "code": getattr(exc, "code", "refused"),
                    "consumer": lp.consumer}  # fmt: skip
        logger.info("control: %s %s %s", what, lp.model, " ".join(args))
        reply["models"].append(lp.model)
        names = list(getattr(lp.runner, "lora_adapters", ()))
        reply["lora_adapters"][lp.model] = names
        # what `celery control` prints of a reply
        reply["ok"] = f"{what} {args[0]}: {lp.model} serves {', '.join(names) or 'no adapter'}"
        try:
            _record_lora(lp, what, *args)
        except redis.RedisError as exc:  # served here all the same
            reply["lora_error"] = f"{lp.model}: not recorded for workers started later: {exc}"
        try:
            publish_info(lp)
        except redis.RedisError as exc:  # served all the same; the next change publishes it
            reply["info_error"] = f"{lp.model}: the model info was not published: {exc}"
    return reply


@control_command(args=[("model", str)], signature="[model]")
def bf_reset_prefix_cache(state: Any, model: str | None = None) -> dict[str, Any]:
    """Empty the prefix cache of a generating model (all of this worker's, or one's) before
    its next step: vLLM's ``/reset_prefix_cache`` (after new weights or adapters, or to
    benchmark cold prompts). ``cleared``: the models that have one (the others: nothing
    to empty)."""
    loops = _loops(state, model)
    if not loops:
        return _elsewhere(state, model)
    cleared = []
    for lp in loops:
        reset = getattr(lp.runner, "reset_prefix_cache", None)
        if reset is not None and reset():
            cleared.append(lp.model)
            logger.info("control: reset_prefix_cache %s", lp.model)
    return {"ok": f"reset_prefix_cache: {', '.join(cleared) or 'no prefix cache here'}",
            "models": [lp.model for lp in loops], "cleared": cleared,
            "consumer": loops[0].consumer}  # fmt: skip


def _record_lora(loop: BatchLoop, what: str, name: str, path: str = "") -> None:
    """Fleet-wide state: every worker the broadcast reaches writes the same (idempotent)."""
    if loop.streams is None:
        return
    if what == "load_lora":
        loop.streams.lora_loaded(name, path)
    else:
        loop.streams.lora_unloaded(name)


def restore_loras(streams: ModelStreams, runner: Runner, model: str) -> None:
    """At startup, before the model info is published: load the adapters loaded while the
    model served (``bf:{model}:lora``) besides the fleet file's (which win on a name
    clash), and unload the fleet file's that were unloaded while it served. One this
    worker cannot load (a directory missing on this host, a refused adapter, past
    ``max_loras``) is logged and skipped: the worker serves the rest."""
    load = getattr(runner, "load_lora", None)
    if load is None:
        return
    try:
        recorded = streams.loras()
    except redis.RedisError as exc:
        logger.warning("%s: the LoRA adapters loaded while serving were not read: %s", model, exc)
        return
    configured = set(getattr(runner, "lora_adapters", ()))
    for name in sorted(n for n, path in recorded.items() if path is None and n in configured):
        runner.unload_lora(name)  # type: ignore[attr-defined]
        logger.info("%s: LoRA adapter %r of the fleet file was unloaded while serving "
                    "(bf:{%s}:lora): not served", model, name, model)  # fmt: skip
    for name, path in sorted(recorded.items()):
        if path is None:
            continue
        if name in configured:
            logger.info("%s: LoRA adapter %r of bf:{%s}:lora is the fleet file's: kept the "
                        "fleet file's", model, name, model)  # fmt: skip
            continue
        try:
            load(name, path)
        except Exception as exc:  # never stops the worker
            logger.warning("%s: LoRA adapter %r (%s) loaded while serving is skipped: %s",
                           model, name, path, exc)  # fmt: skip
        else:
            logger.info("%s: LoRA adapter %r (%s) loaded while serving, loaded again",
                        model, name, path)  # fmt: skip


def publish_info(loop: BatchLoop) -> None:
    """Publish a loop's model info again (its runner changed what it serves), for the
    gateways' ``/v1/models``; also what its intake publishes when it reconnects."""
    if loop.streams is None:
        return
    info = model_info(loop.runner, loop.config.limits, int(time.time()), loop.config)
    if hasattr(loop.parts.source, "info"):
        loop.parts.source.info = info
    loop.streams.publish_info(info)


@inspect_command()
def bf_state(state: Any) -> dict[str, Any]:
    """Each batch loop's state (running, paused, draining), policy and queue depths."""
    return {lp.model: loop_info(lp) for lp in _loops(state, None)}
