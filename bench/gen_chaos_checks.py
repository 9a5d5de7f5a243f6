"""The invariants a generation chaos run (``bench.gen_chaos``) checks once every request
is answered, per request and for the fleet; each broken one is a violation naming the
request. Shared with ``tests/test_faults_generation.py``."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import redis
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.messages import Delta
from batchfleet.schemas.results import Result

from .gen_chaos_greedy import check_greedy

ALLOWED_ERRORS = {"poisoned"}
"""The one error a chaos run may give: a request whose holders kept dying past
``max_deliveries`` is dead-lettered (docs/reliability.md, "Poison requests"): the fleet
cannot tell it from one that crashes workers."""


@dataclass(frozen=True)
class Plan:
    """One request's shape."""

    rid: str
    prompt: str
    max_new: int
    lane: int
    greedy: bool
    ignore_eos: bool
    stop: list[str] | None
    cancel_after: float | None
    deadline_ms: int | None
    reader: str
    """``deltas`` (``job.deltas()``), ``stream`` (``job.stream()``), ``reply`` (the reply
    channel's delta messages) or ``none``."""


@dataclass
class Seen:
    """What a live reader got: deltas in order (None for a :class:`Restarted` marker), or
    ``job.stream()``'s text, or the error it raised."""

    events: list[Delta | None] = field(default_factory=list)
    text: str | None = None
    error: str | None = None


class Replies(Protocol):
    deltas: dict[str, list[tuple[int, int, str]]]
    results: dict[str, int]


@dataclass
class Report:
    violations: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)
    events: list[str] = field(default_factory=list)
    """The chaos done: each kill -9 and restart."""
    ties: list[str] = field(default_factory=list)
    """Greedy tokens accepted though one at a time decoding chose another, tied with it
    within float32 rounding (:mod:`.gen_chaos_greedy`): not violations, shown apart."""

    def bad(self, rid: str, what: str) -> None:
        self.violations.append(f"{rid}: {what}")

    def print(self, elapsed: float) -> None:
        n, events = sum(self.outcomes.values()), len(self.events)
        print(f"\n{n} requests in {elapsed:.0f} s, {events} chaos events")
        print(f"{'outcome':<28}{'requests':>10}")
        for outcome, n in sorted(self.outcomes.items()):
            print(f"{outcome:<28}{n:>10}")
        print(f"{'check':<40}{'count':>10}")
        for check, n in sorted(self.counts.items()):
            print(f"{check:<40}{n:>10}")
        if self.ties:
            print(f"greedy ties broken otherwise (accepted): {len(self.ties)}")
            for line in self.ties[:10]:
                print(f"  {line}")
        print(f"violations: {len(self.violations)}")
        for line in self.violations[:40]:
            print(f"  {line}")
        if len(self.violations) > 40:
            print(f"  ... and {len(self.violations) - 40} more")


def attempts(
    entries: list[tuple[bytes, dict[bytes, bytes]]],
) -> tuple[list[list[dict[str, str]]], int]:
    """A stored token stream split into attempts (a ``seq`` not above the last one starts
    one, an end's too: an empty one), ends left out; and how many end entries it holds."""
    runs: list[list[dict[str, str]]] = []
    ends, last = 0, 0
    for _, raw in entries:
        f = {k.decode(): v.decode() for k, v in raw.items()}
        seq = int(f["seq"])
        if "end" in f:
            ends += 1
            if seq <= last:  # an attempt that streamed nothing ended it
                runs.append([])
            continue
        if seq <= last or not runs:
            runs.append([])
        runs[-1].append(f)
        last = seq
    return runs, ends


def layout(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> str:
    """A stream's entries as runs of ``life:first-last`` (``E`` for an end), to read one."""
    runs: list[list[Any]] = []
    for _, f in entries:
        life, seq = f.get(b"life", b"-").decode(), int(f[b"seq"])
        if b"end" in f:
            runs.append([life, seq, seq, "E"])
        elif runs and runs[-1][0] == life and runs[-1][2] + 1 == seq and runs[-1][3] == "":
            runs[-1][2] = seq
        else:
            runs.append([life, seq, seq, ""])
    return " ".join(f"{r[0]}:{r[1]}-{r[2]}{r[3]}" for r in runs)


def texts_by_input(pieces: list[tuple[int, str]]) -> dict[int, str]:
    out: dict[int, str] = {}
    for i, text in pieces:
        out[i] = out.get(i, "") + text
    return out


def check_stored_stream(
    r: redis.Redis, keys: ModelKeys, res: Result, report: Report, cut: bool = False
) -> int:
    """The token stream as stored: one end, last; each attempt ``1..k``; ``life`` never
    going back; the last attempt's text the result's; a TTL; ``cut`` (a kill cut an
    attempt after a delta): a restart. Its attempt count."""
    rid = res.id
    entries: Any = r.xrange(keys.tokens(rid))  # redis-py types replies loosely
    if not entries:
        if res.ok:
            report.bad(rid, "answered ok without a token stream")
        return 0
    runs, ends = attempts(entries)
    last = {k.decode(): v.decode() for k, v in entries[-1][1].items()}
    # an error answered without generating (poisoned: dead-lettered) ends no stream
    if ends > 1 or (res.ok and ends == 0):
        report.bad(rid, f"{ends} end entries: the result was written {ends} times")
    if ends and "end" not in last:
        report.bad(rid, "the stream's last entry is not its end")
    lives = [int(f["life"]) for run in runs for f in run if "life" in f]
    if lives != sorted(lives):
        report.bad(rid, f"an earlier attempt's entry followed a later one's (life {lives})")
    for run in runs:
        seqs = [int(f["seq"]) for f in run]
        if seqs != list(range(1, len(seqs) + 1)):
            report.bad(rid, f"seq gap within an attempt: {seqs[:12]}")
    final = runs[-1] if runs else []
    if "end" in last and int(last["seq"]) != len(final) + 1:
        report.bad(rid, f"end seq {last['seq']} after {len(final)} deltas: {layout(entries)}")
    if res.ok:
        got = texts_by_input([(int(f.get("input", 0)), f.get("text", "")) for f in final])
        want = {i: g.text for i, g in enumerate(res.generations()) if g.text}
        if {i: t for i, t in got.items() if t} != want:
            report.bad(rid, "the last attempt's deltas are not the result's text")
    if cut and res.ok and len(runs) < 2:  # (an error result may end no stream: poisoned)
        report.bad(rid, f"killed mid-generation, its stream shows no restart: {layout(entries)}")
    ttl = r.ttl(keys.tokens(rid))
    if ttl < 0:
        report.bad(rid, f"token stream without a TTL ({ttl})")
    return len(runs)


def check_reader(plan: Plan, seen: Seen, res: Result, report: Report) -> None:
    """What a live reader got: after its last restart, ``1..k`` and the result's text.
    ``job.stream()`` refusing a restart (``StreamRestarted``) is right only where the text
    generated again may differ from the first: a greedy one cut by its deadline or cancel."""
    rid = plan.rid
    cut = plan.deadline_ms is not None or plan.cancel_after is not None
    if seen.error and seen.error.startswith("StreamRestarted") and cut:
        report.counts["job.stream() refused a cut restart"] += 1
        return
    if seen.error and res.ok:
        report.bad(rid, f"reader failed: {seen.error}")
    if seen.error or not res.ok:  # an error result has no text to match
        return
    text = res.generations()[0].text
    if seen.text is not None:
        if seen.text != text:
            report.bad(rid, f"job.stream() gave {seen.text[:40]!r}, result {text[:40]!r}")
        return
    marks = [i for i, e in enumerate(seen.events) if e is None]
    report.counts["resets a reader saw"] += len(marks)
    after = [e for e in seen.events[(marks[-1] + 1 if marks else 0) :] if e is not None]
    if [d.seq for d in after] != list(range(1, len(after) + 1)):
        report.bad(rid, f"reader's seq after its last reset: {[d.seq for d in after][:12]}")
    if "".join(d.text for d in after) != text:
        report.bad(rid, "reader's deltas after its last reset are not the result's text")


def check_reply(rid: str, pieces: list[tuple[int, int, str]], res: Result, report: Report) -> None:
    """Delta messages on the reply channel (only for requests no outage overlapped)."""
    report.counts["reply-channel readers checked"] += 1
    start = max((i for i, p in enumerate(pieces) if i and p[0] <= pieces[i - 1][0]), default=0)
    after = pieces[start:]
    if [p[0] for p in after] != list(range(1, len(after) + 1)):
        report.bad(rid, f"reply channel seq after its last reset: {[p[0] for p in after][:12]}")
    text = res.generations()[0].text if res.ok else ""
    if "".join(p[2] for p in after) != text:
        report.bad(rid, "reply channel deltas after its last reset are not the result's text")


def outcome(plan: Plan, res: Result, report: Report) -> str:
    """The result's outcome, a violation where the plan does not allow it."""
    if not res.ok:
        code = str(getattr(res.error.code, "value", res.error.code)) if res.error else "?"
        allowed = code in ALLOWED_ERRORS or (code == "deadline_exceeded" and plan.deadline_ms)
        if not allowed:
            report.bad(res.id, f"{res.status} {code}: {res.error}")
        return f"{res.status} {code}"
    reason = res.generations()[0].finish_reason
    allowed_reasons = {"stop", "length"}
    allowed_reasons |= {"cancelled"} if plan.cancel_after is not None else set()
    allowed_reasons |= {"deadline"} if plan.deadline_ms else set()
    if reason not in allowed_reasons:
        report.bad(res.id, f"finish_reason {reason}")
    return f"ok {reason}"


def model_path(config: Path) -> Path:
    for line in config.read_text().splitlines():
        if line.startswith("path = "):
            return Path(line.split('"')[1])
    raise ValueError(f"no model path in {config}")


def check_fleet(r: redis.Redis, keys: ModelKeys, report: Report, wait_s: float) -> None:
    """Nothing left in a lane or pending in its group, within ``wait_s``: an entry whose
    read reply a Redis kill lost stays pending on its live reader until the idle fallback
    (``claim_idle_ms``) takes it (then retired: a producer's resubmission answered it).
    Every token stream has a TTL."""
    lanes = [keys.lane(lane) for lane in range(int(r.get(keys.lanes_key) or 3))]
    end = time.monotonic() + wait_s
    while True:
        left = {lane: (r.xlen(lane), r.xpending(lane, GROUP)["pending"]) for lane in lanes}
        if not any(n or p for n, p in left.values()) or time.monotonic() > end:
            break
        time.sleep(0.5)
    for lane, (n, p) in left.items():
        if n or p:
            report.bad(lane, f"{n} entries left, {p} pending {wait_s:.0f} s after the last result")
    for key in r.scan_iter(match=keys.tokens("*"), count=1000):
        if r.ttl(key) < 0:
            report.bad(key.decode(), "token stream without a TTL")


def check_run(
    r: redis.Redis, model: str, plans: list[Plan], results: dict[str, Result],
    seen: dict[str, Seen], replies: Replies, submitted: dict[str, float],
    deaf: list[tuple[float, float]], verify: int, config: Path, drain_s: float,
    cut: Collection[str] = (),
) -> Report:  # fmt: skip
    """Every invariant over a finished run; ``cut``: requests whose worker was killed
    after a delta, before their end (their stored streams must show the restart)."""
    keys = ModelKeys(model)
    report = Report()
    greedy: list[tuple[int, Result]] = []
    for plan in plans:
        res = results.get(plan.rid)
        if res is None:
            report.bad(plan.rid, f"no result: {whereabouts(r, keys, plan.rid)}")
            report.outcomes["lost"] += 1
            continue
        report.outcomes[outcome(plan, res, report)] += 1
        runs = check_stored_stream(r, keys, res, report, plan.rid in cut)
        report.counts["streams regenerated (>1 attempt)"] += runs > 1
        report.counts["requests a kill cut mid-generation"] += plan.rid in cut
        if plan.rid in seen:
            check_reader(plan, seen[plan.rid], res, report)
            report.counts[f"live readers checked ({plan.reader})"] += 1
        if replies.results.get(plan.rid, 0) > 1:
            report.counts["results published twice (resubmitted)"] += 1
        quiet = not any(a <= res_time(res, submitted, plan) and b >= submitted.get(plan.rid, 0)
                        for a, b in deaf)  # fmt: skip
        if plan.reader == "reply" and quiet and res.ok:
            check_reply(plan.rid, replies.deltas.get(plan.rid, []), res, report)
        if plan.greedy and res.ok:
            greedy.append((runs, res))
    greedy.sort(key=lambda x: -x[0])
    check_greedy(model_path(config), [res for _, res in greedy[:verify]], report)
    check_fleet(r, keys, report, drain_s)
    return report


def whereabouts(r: redis.Redis, keys: ModelKeys, rid: str) -> str:
    """Where an unanswered request stands: its result stored since (late, not lost), the
    worker its ``started`` key names, and its token stream's layout."""
    started: Any = r.get(keys.started(rid))
    entries: Any = r.xrange(keys.tokens(rid))
    name = started.decode() if started else "none"
    late = "stored since, " if r.exists(keys.result(rid)) else ""
    return f"{late}started by {name}, stream {layout(entries) if entries else 'empty'}"


def res_time(res: Result, submitted: dict[str, float], plan: Plan) -> float:
    """When the result was about stored (monotonic): its submit time plus its total."""
    return submitted.get(plan.rid, 0.0) + res.timings.total_ms / 1000 + 1.0
