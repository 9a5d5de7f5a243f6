"""A server, worker or pool process started by batchfleet or the tests dies with the process
that started it, even on SIGKILL (real processes: a child Python starts it, the test kills
the child)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cluster_helpers
import pytest
import redis
from cluster_helpers import LocalRedisCluster
from conftest import fleet_toml

from batchfleet import tied_process
from batchfleet.redis_server import LocalRedis, find_server
from batchfleet.tied_process import PDEATHSIG_SUPPORTED, tied_popen

linux_only = pytest.mark.skipif(not PDEATHSIG_SUPPORTED, reason="PR_SET_PDEATHSIG is Linux's")

GONE_WITHIN_S = 10.0
"""How long a killed server may take to disappear (the kernel's SIGKILL is at once)."""

STARTER = """
import json, os, sys, threading, time
from batchfleet.redis_server import LocalRedis

started = []
def start():
    server = LocalRedis()
    server.start()
    started.append(server)

if sys.argv[1] == "thread":
    thread = threading.Thread(target=start)
    thread.start()
    tid = thread.native_id
    thread.join()
    # the kernel sends the death signals of a thread's children at its exit, before its
    # task leaves /proc: once it is gone, a server tied to that thread would be dead
    end = time.monotonic() + 10
    while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < end:
        time.sleep(0.01)
else:
    start()
print(json.dumps({"pid": started[0].process.pid, "port": started[0].port}), flush=True)
sys.stdin.read()
"""
"""A parent that starts a server (from its main thread, or from a thread that then ends),
says the server's pid and port, and waits to be killed."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no reaper has collected yet counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int) -> bool:
    end = time.monotonic() + GONE_WITHIN_S
    while alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def started_at(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot): with the pid, which process it is."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None


def descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on."""
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                for child in map(int, (task / "children").read_text().split()):
                    found += [child, *descendants(child)]
    return found


class Reaper:
    """Processes SIGKILLed at the end if they still run, so a failing test leaks none."""

    def __init__(self) -> None:
        self.started: dict[int, str | None] = {}

    def add(self, *pids: int) -> None:
        self.started.update((pid, started_at(pid)) for pid in pids)

    def kill_left(self) -> None:
        for pid, since in self.started.items():
            if since is not None and alive(pid) and started_at(pid) == since:  # (not a reuse)
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def reap() -> Iterator[Reaper]:
    reaper = Reaper()
    yield reaper
    reaper.kill_left()


@linux_only
@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_a_server_dies_with_its_sigkilled_parent(
    started_from: str, reap: Reaper, tmp_path: Path
) -> None:
    # Given a Python process that started a server (from a thread that has since ended)
    argv = [sys.executable, "-c", STARTER, started_from]
    env = dict(os.environ, TMPDIR=str(tmp_path))  # (the data folder the killed one leaves)
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) as parent:
        assert parent.stdout is not None
        said = json.loads(parent.stdout.readline())
        reap.add(said["pid"])
        with redis.Redis(port=said["port"], socket_timeout=5) as client:
            assert client.ping()  # (not killed with the thread that started it)
            assert client.info("server")["process_id"] == said["pid"]  # the server itself
        # When the parent is SIGKILLed
        parent.kill()
    # Then the server is gone too
    assert wait_gone(said["pid"]), f"server {said['pid']} outlived its parent"


@linux_only
def test_the_shim_runs_nothing_once_its_parent_has_died(tmp_path: Path) -> None:
    # Given the shim told of a parent other than the one it has (the parent died between
    # the fork and the prctl; the child was reparented)
    marker = tmp_path / "ran"
    program = ["/bin/sh", "-c", f"touch {marker}"]
    shim = [sys.executable, "-I", "-S", "-c", tied_process._SHIM]
    no_signals = ""
    # When it runs, Then it exits without running the program
    died = [*shim, str(os.getpid() + 1), no_signals, *program]
    assert subprocess.run(died, capture_output=True).returncode
    assert not marker.exists()
    # (and with its real parent, runs it)
    assert subprocess.run([*shim, str(os.getpid()), no_signals, *program]).returncode == 0
    assert marker.exists()


@pytest.mark.parametrize("tied", [True, False], ids=["pdeathsig", "plain"])
def test_the_child_is_the_program_itself(tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given tied_popen with the shim (Linux) or without (elsewhere)
    if tied and not PDEATHSIG_SUPPORTED:
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    monkeypatch.setattr(tied_process, "PDEATHSIG_SUPPORTED", tied)
    # When it runs a program, Then its pid, arguments, pipes and exit status are the
    # program's, and it does not ignore SIGPIPE (Python does, Popen restores it)
    child = tied_popen(
        ["sh", "-c", 'echo "$$ $0 $1" >&2; grep SigIgn /proc/$$/status; exit 3', "zero", "one"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = child.communicate(timeout=30)
    assert (child.returncode, err.decode()) == (3, f"{child.pid} zero one\n")
    if sys.platform == "linux":  # (/proc)
        ignored = int(out.split()[1], 16)
        assert not ignored & (1 << (signal.SIGPIPE - 1)), f"SigIgn {ignored:x}"
    with pytest.raises(FileNotFoundError, match="no such program: no-such-program-here"):
        tied_popen(["no-such-program-here"])


@linux_only  # (/proc)
@pytest.mark.parametrize("tied", [True, False], ids=["pdeathsig", "plain"])
def test_the_options_mean_what_they_mean_to_popen(
    tied: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Given tied_popen with the shim or without, this process ignoring SIGINT (as one run
    # in the background does)
    monkeypatch.setattr(tied_process, "PDEATHSIG_SUPPORTED", tied)
    script = 'read line; echo "$line $WHO $(pwd)"; cut -d" " -f6 /proc/$$/stat; grep SigIgn /proc/$$/status'
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        # When it runs a program with stdin, env, cwd, a new session, SIGINT at its
        # default, in text mode
        child = tied_popen(
            ["sh", "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={"WHO": "me", "PATH": os.environ["PATH"]},
            cwd=tmp_path,
            start_new_session=True,
            default_signals=[signal.SIGINT],
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    out, _ = child.communicate("hello\n", timeout=30)
    # Then the program reads what was written, sees that env in that folder, leads its own
    # session and does not ignore SIGINT
    said, session, ignored = out.splitlines()
    assert said == f"hello me {os.path.realpath(tmp_path)}"
    assert int(session) == child.pid
    assert not int(ignored.split()[1], 16) & (1 << (signal.SIGINT - 1)), ignored


BARE_APP = """
import ctypes, os
from celery import Celery, signals

app = Celery("bare", broker=os.environ["BROKER"])
if os.environ.get("UNTIE_POOL"):  # (the mutation check: pool processes not tied)
    signals.worker_process_init.connect(lambda **_: ctypes.CDLL(None).prctl(1, 0, 0, 0, 0), weak=False)
"""
"""A Celery app with no tasks: the prefork pool as Celery starts it, without a model."""

WORKER_STARTER = """
import contextlib, json, os, subprocess, sys
from pathlib import Path

import redis

url, workdir, fleet, kind = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
if kind == "demo":
    from batchfleet.demo_workers import worker_process

    stack = contextlib.ExitStack()  # (kept: a collected one would stop the worker)
    worker = stack.enter_context(worker_process(url, workdir, "tiny", fleet))
    worker.wait_ready(url)
    pid = worker.proc.pid
elif kind == "tests":
    from conftest import WorkerProcess

    config = workdir / "tiny.toml"
    config.write_text(f'redis_url = "{url}"\\n{fleet}')
    process = WorkerProcess(config, "tied", workdir / "tied.log")
    process.wait_ready(redis.Redis.from_url(url), "tiny")
    pid = process.process.pid
else:  # a prefork pool of 2
    from batchfleet.tied_process import tied_popen

    argv = [sys.executable, "-m", "celery", "-A", "bare_app", "worker", "--pool", "prefork",
            "-c", "2", "--without-mingle", "--without-gossip"]
    log = (workdir / "prefork.log").open("wb")
    env = dict(os.environ, BROKER=url)
    pid = tied_popen(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT).pid
print(json.dumps({"pid": pid}), flush=True)
sys.stdin.read()
"""
"""A parent that starts a worker (the demo's, the tests' WorkerProcess, or a Celery worker
with a prefork pool), says its pid once it is ready, and waits to be killed."""


@linux_only
@pytest.mark.parametrize("kind", ["demo", "tests", "prefork"])
def test_a_worker_and_its_pool_die_with_their_sigkilled_starter(
    kind: str, redis_url: str, tiny_embedder: Path, reap: Reaper, tmp_path: Path
) -> None:
    # Given a Python process that started a worker, ready (a prefork pool: its 2 processes)
    (tmp_path / "bare_app.py").write_text(BARE_APP)
    fleet = fleet_toml(redis_url, {"tiny": {"runner": "embedding", "path": str(tiny_embedder)}})
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, UNTIE_POOL="")
    argv = [sys.executable, "-c", WORKER_STARTER, redis_url, str(tmp_path),
            fleet.partition("\n")[2], kind]  # fmt: skip
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) as parent:
        assert parent.stdout is not None
        worker = json.loads(parent.stdout.readline())["pid"]
        reap.add(worker)
        end = time.monotonic() + 120
        while kind == "prefork" and len(descendants(worker)) < 2:
            assert alive(worker) and time.monotonic() < end, "no pool of 2 came up"
            time.sleep(0.1)
        started = [worker, *descendants(worker)]
        reap.add(*started)
        # When the starter is SIGKILLed
        parent.kill()
    # Then the worker and every process it started are gone too
    assert [pid for pid in started if not wait_gone(pid)] == [], "outlived their starter"


def test_a_start_interrupted_before_the_server_answers_stops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a server whose start is interrupted while waiting for its first PONG
    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalRedis, "_wait_ping", interrupted)
    server = LocalRedis()
    with pytest.raises(KeyboardInterrupt):
        server.start()
    # Then the server is stopped and its data directory gone
    assert server.process is not None and server.process.poll() is not None
    assert server._dir is None


def test_a_server_that_exits_at_start_leaves_no_data_directory() -> None:
    server = LocalRedis(extra_args=["--no-such-option", "1"])
    with pytest.raises(RuntimeError, match="exited with"):
        server.start()
    assert server._dir is None


def test_a_cluster_that_never_forms_stops_its_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    if find_server().cli is None:
        pytest.skip(f"{find_server().server} comes without a CLI to create a cluster")

    # Given three cluster nodes started, and their join failing
    def never_forms(*_: object) -> None:
        raise TimeoutError("cluster never formed")

    monkeypatch.setattr(LocalRedisCluster, "_join", never_forms)
    started: list[subprocess.Popen[bytes]] = []

    def recorded(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(tied_popen(args, **kwargs))
        return started[-1]

    monkeypatch.setattr(cluster_helpers, "tied_popen", recorded)
    with pytest.raises(TimeoutError):
        LocalRedisCluster().start()
    # Then every node it started has ended
    assert len(started) == 3 and all(p.returncode is not None for p in started)
