"""A generation chaos run, small (``bench.gen_chaos``): real processes (Redis with AOF,
two generating workers, streaming readers), workers kill -9'd and restarted, Redis
kill -9'd and restarted once; every request answered once, each stream's last attempt
its result, greedy answers those of one-at-a-time decoding, nothing left pending. And
the harness itself: a fleet that does not get ready, or a run stopped by Ctrl-C (SIGINT),
stops every process it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from batchfleet.schemas.keys import ModelKeys

from batchfleet.tied_process import tied_popen
from bench import gen_chaos
from bench.systems import ROOT

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


EXIT_GUARD_S = 30.0
"""How long an interrupted run may take to stop and exit: generous (it kills its
processes and exits in seconds), yet shorter than a reader's 60 s of retries on a dead
Redis (a ``ThreadPoolExecutor``'s threads, joined at exit, held it that long and more)."""


def test_ctrl_c_stops_the_run_its_workers_and_redis(tmp_path: Path) -> None:
    # Given the harness as a real process (its own session, SIGINT handled as from a
    # terminal) with one worker, submitting 200 streaming requests over 20 s, no chaos
    argv = [sys.executable, "-m", "bench.gen_chaos", "--requests", "200", "--rate", "10",
            "--workers", "1", "--hidden", "64", "--kill-every", "100000", "--redis-restarts",
            "0", "--verify", "0", "--timeout", "300", "--workdir", str(tmp_path)]  # fmt: skip
    harness = tied_popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True, text=True, default_signals=[signal.SIGINT])  # fmt: skip
    lines: list[str] = []
    started: list[tuple[int, int]] = []
    try:
        url = _fleet_up(harness, lines)
        # When a request is mid-generation (a reader waits on its stream), Ctrl-C
        _wait_generating(redis.Redis.from_url(url), harness)
        started = _descendants(harness.pid)
        harness.send_signal(signal.SIGINT)
        # Then it exits, interrupted, and no process it started is left
        harness.wait(EXIT_GUARD_S)
        tail = "".join(lines[-20:])
        assert harness.returncode == gen_chaos.INTERRUPTED, tail
        assert len(started) >= 2, started  # (the worker and Redis at least)
        assert [p for p in started if _alive(p)] == [], tail
    finally:
        if harness.poll() is None:
            harness.kill()
        for pid, since in started:
            if _alive((pid, since)):
                os.kill(pid, signal.SIGKILL)
        harness.wait()


def test_a_reader_still_waiting_does_not_keep_the_harness_from_exiting() -> None:
    # Given the harness's reader pool, one reader waiting for ever (as one following a
    # stream of a dead Redis retries: an interrupted run hung so, its pool's threads
    # joined at exit)
    code = ("import threading; from bench.gen_chaos import Readers; "
            "Readers(2).submit(threading.Event().wait); print('submitted', flush=True)")  # fmt: skip
    # When the process ends its main thread
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=EXIT_GUARD_S)  # fmt: skip
    # Then it exits (a timeout fails the test)
    assert (done.returncode, done.stdout) == (0, "submitted\n"), done.stderr


def _fleet_up(harness: subprocess.Popen[str], lines: list[str]) -> str:
    """Read the harness's output until its fleet is up (its workers ready); Redis's URL.
    Its later output is read on, by a thread, so it never blocks on a full pipe."""
    assert harness.stdout is not None
    for line in harness.stdout:
        lines.append(line)
        if m := re.match(r"fleet up: redis (\S+) ", line):
            threading.Thread(target=lines.extend, args=(harness.stdout,), daemon=True).start()
            return m.group(1)
    raise AssertionError(f"the harness ended before its fleet was up: {''.join(lines)[-3000:]}")


def _wait_generating(r: redis.Redis, harness: subprocess.Popen[str]) -> None:
    """Until a worker has started a request (its ``started`` key), the harness running."""
    pattern = ModelKeys(gen_chaos.MODEL).started("*")
    while not next(r.scan_iter(match=pattern, count=1000), None):
        assert harness.poll() is None, "the harness ended before any request started"
        time.sleep(0.05)  # (polling another process: nothing to wait on)


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command's name (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _descendants(pid: int) -> list[tuple[int, int]]:
    """The processes below ``pid`` (children, theirs, ...), each with its start time (so
    a pid reused since is not taken for it)."""
    stats = {int(e): st for e in os.listdir("/proc") if e.isdigit() and (st := _stat(int(e)))}
    out: list[tuple[int, int]] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, st in stats.items() if int(st[1]) == parent]
        out += [(p, int(stats[p][19])) for p in kids]
        todo += kids
    return out


def _alive(process: tuple[int, int]) -> bool:
    """Whether this process (pid, start time) runs (a zombie, ended, does not)."""
    st = _stat(process[0])
    return st is not None and int(st[19]) == process[1] and st[0] != "Z"
