"""A generation chaos run, small (``bench.gen_chaos``): real processes (Redis with AOF,
two generating workers, streaming readers), workers kill -9'd and restarted, Redis
kill -9'd and restarted once; every request answered once, each stream's last attempt
its result, greedy answers those of one-at-a-time decoding, nothing left pending."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import gen_chaos

pytestmark = pytest.mark.timeout(400)


def test_generation_survives_kill_9_of_workers_and_of_redis(tmp_path: Path) -> None:
    # Given 40 streaming requests (mixed lengths, greedy and seeded, stops, cancels,
    # deadlines; read by job.deltas(), job.stream() and the reply channel) over two workers
    argv = ["--requests", "40", "--rate", "10", "--workers", "2", "--kill-every", "2",
            "--worker-kills", "2", "--redis-restarts", "1", "--verify", "8", "--readers", "24",
            "--reader-mix", "8,1,1,0", "--seed", "3",
            "--claim-idle-ms", "10000", "--timeout", "240", "--workdir", str(tmp_path)]  # fmt: skip
    # When a worker is kill -9'd (restarted) twice, 1-3 s apart, each time once one is past
    # a request's first delta and before its end (the chaos thread waits for one), and
    # Redis once (two kills poison nothing: a request is dead-lettered at its 4th delivery)
    report = gen_chaos.run(gen_chaos.parse(argv))
    # Then nothing was lost, doubled or streamed wrong
    assert report.violations == [], report.violations
    assert sum(o for k, o in report.outcomes.items() if k.startswith("ok")) >= 30
    kills = [e for e in report.events if "worker" in e]
    assert kills and sum("redis" in e for e in report.events) == 1, report.events
    # every kill cut a stream (its restart checked above), so the run checked restarts
    assert report.counts["requests a kill cut mid-generation"] >= 1, report.events
    assert report.counts["streams regenerated (>1 attempt)"] >= 1


def test_a_fleet_that_does_not_get_ready_stops_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given workers that cannot be ready in time (no time at all)
    monkeypatch.setattr(gen_chaos.Fleet, "READY_S", 0.0)
    started: list[gen_chaos.Fleet] = []
    monkeypatch.setattr(gen_chaos.Fleet, "wait_ready", _recording(started))
    # When the fleet's start times out
    with pytest.raises(TimeoutError, match="workers not ready"):
        gen_chaos.Fleet(tmp_path, 2, "always", "", hidden=32)
    # Then its worker processes and its Redis were stopped, not left orphaned
    (fleet,) = started
    assert len(fleet.procs) == 2
    assert all(p.poll() is not None for p in fleet.procs)
    assert fleet.redis.process is not None and fleet.redis.process.poll() is not None


def _recording(started: list[gen_chaos.Fleet]) -> object:
    wait_ready = gen_chaos.Fleet.wait_ready

    def record(self: gen_chaos.Fleet, within_s: float) -> None:
        started.append(self)
        wait_ready(self, within_s)

    return record
