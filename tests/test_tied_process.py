"""A server started by batchfleet dies with the process that started it, even on SIGKILL
(real processes: a child Python starts the server, the test kills the child)."""

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


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Server pids SIGKILLed at the end if they still run one, so a failing test leaks no
    server."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            if alive(pid) and b"-server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


@linux_only
@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_a_server_dies_with_its_sigkilled_parent(
    started_from: str, reap: list[int], tmp_path: Path
) -> None:
    # Given a Python process that started a server (from a thread that has since ended)
    argv = [sys.executable, "-c", STARTER, started_from]
    env = dict(os.environ, TMPDIR=str(tmp_path))  # (the data folder the killed one leaves)
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) as parent:
        assert parent.stdout is not None
        said = json.loads(parent.stdout.readline())
        reap.append(said["pid"])
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
    # When it runs, Then it exits without running the program
    assert subprocess.run([*shim, str(os.getpid() + 1), *program], capture_output=True).returncode
    assert not marker.exists()
    # (and with its real parent, runs it)
    assert subprocess.run([*shim, str(os.getpid()), *program]).returncode == 0
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
