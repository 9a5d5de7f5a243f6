"""Child processes that die with the process that started them, even when it is SIGKILLed.

A Redis server started for the demo or a test and left behind by a parent killed with
SIGKILL (an OOM kill, a CI timeout) would run forever, holding its port, memory and CPU.
On Linux :func:`tied_popen` starts the program through a tiny Python shim that asks the
kernel for a SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``) and then execs the
program in its place, so the pid, pipes and exit status are the program's own.
(``Popen(preexec_fn=...)`` would do the same in the forked child, but is unsafe in a
process with threads.) SIGKILL rather than SIGTERM: nobody is left to read the server's
data, a server stopped with SIGSTOP (the failover tests stop replicas) would never act on
a SIGTERM, and one with replicas would first wait for them to catch up.

The kernel's "parent" is the *thread* that forked: a child forked by a thread that later
ends is killed with that thread. So every tied child is forked by one daemon thread that
lives as long as the process. Elsewhere than Linux: a plain ``Popen``.

A tied Celery worker needs nothing more for its prefork pool: Celery's pool processes ask
for the same SIGKILL when the worker dies (``celery.concurrency.prefork`` sets it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from queue import SimpleQueue
from typing import IO, Any, Literal, overload

PDEATHSIG_SUPPORTED = sys.platform == "linux"

_SHIM = """\
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0):
    sys.exit(f"prctl(PR_SET_PDEATHSIG): errno {ctypes.get_errno()}")
if os.getppid() != int(sys.argv[1]):
    sys.exit("the parent died before the death signal was set")
# Python ignores SIGPIPE and SIGXFSZ, Popen restores them for the program it runs: so does
# this, with the signals the caller asked to have at their default too
for number in [signal.SIGPIPE, signal.SIGXFSZ, *map(int, filter(None, sys.argv[2].split(",")))]:
    signal.signal(number, signal.SIG_DFL)
os.execv(sys.argv[3], sys.argv[3:])
"""
"""Run as ``python -I -S -c _SHIM <parent pid> <signals> <program> <args...>`` (``signals``:
numbers, comma-separated, maybe none): the parent-pid check covers a parent that died
between the fork and the ``prctl``."""

_Redirect = int | IO[bytes] | IO[str] | None
_Job = tuple[Callable[[], "subprocess.Popen[Any]"], "Future[subprocess.Popen[Any]]"]


class _Forker:
    """A daemon thread that runs every tied ``Popen``, so the children's kernel parent is
    a thread that lives as long as the process (started afresh in a forked child)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._lock = threading.Lock()
        self._jobs: SimpleQueue[_Job] = SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, start: Callable[[], subprocess.Popen[Any]]) -> subprocess.Popen[Any]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, args=(self._jobs,), name="batchfleet-forker", daemon=True
                )
                self._thread.start()
            done: Future[subprocess.Popen[Any]] = Future()
            self._jobs.put((start, done))
        return done.result()

    @staticmethod
    def _serve(jobs: SimpleQueue[_Job]) -> None:
        while True:
            start, done = jobs.get()
            try:
                done.set_result(start())
            except BaseException as e:  # handed to the caller, who raises it
                done.set_exception(e)


_forker = _Forker()
if hasattr(os, "register_at_fork"):  # a forked child has no forker thread, maybe a held lock
    os.register_at_fork(after_in_child=_forker.reset)


@overload
def tied_popen(
    args: Sequence[str],
    *,
    stdin: _Redirect = None,
    stdout: _Redirect = None,
    stderr: _Redirect = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    start_new_session: bool = False,
    default_signals: Sequence[int] = (),
    text: Literal[False] = False,
) -> subprocess.Popen[bytes]: ...


@overload
def tied_popen(
    args: Sequence[str],
    *,
    stdin: _Redirect = None,
    stdout: _Redirect = None,
    stderr: _Redirect = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    start_new_session: bool = False,
    default_signals: Sequence[int] = (),
    text: Literal[True],
) -> subprocess.Popen[str]: ...


def tied_popen(
    args: Sequence[str],
    *,
    stdin: _Redirect = None,
    stdout: _Redirect = None,
    stderr: _Redirect = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    start_new_session: bool = False,
    default_signals: Sequence[int] = (),
    text: bool = False,
) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, ...)`` with these arguments' meanings, whose process gets
    SIGKILL when this process dies (Linux; elsewhere a plain ``Popen``).

    ``default_signals``: signals the program starts with at their default action even if
    this process ignores them (what a ``preexec_fn`` would do, without its hazards).
    ``args[0]`` is looked up in ``env``'s ``PATH`` when given, as ``Popen`` does."""
    path = (env if env is not None else os.environ).get("PATH", os.defpath)
    program = shutil.which(args[0], path=path)
    if program is None:  # as Popen raises, not a shim that exits with a traceback
        raise FileNotFoundError(f"no such program: {args[0]}")
    options: dict[str, Any] = {
        "stdin": stdin, "stdout": stdout, "stderr": stderr, "env": env, "cwd": cwd,
        "start_new_session": start_new_session, "text": text,
    }  # fmt: skip
    if not PDEATHSIG_SUPPORTED or not sys.executable:  # (no Python to run the shim with)
        return _popen_with_defaults([program, *args[1:]], default_signals, options)
    signals = ",".join(str(int(s)) for s in default_signals)
    shim = [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), signals]
    argv = [*shim, os.path.abspath(program), *args[1:]]
    return _forker.run(lambda: subprocess.Popen(argv, **options))


def _popen_with_defaults(
    argv: list[str], default_signals: Sequence[int], options: dict[str, Any]
) -> subprocess.Popen[Any]:
    """A plain ``Popen`` (no shim), its ``default_signals`` set in the child."""
    if not default_signals:
        return subprocess.Popen(argv, **options)

    def defaults() -> None:
        for number in default_signals:
            signal.signal(number, signal.SIG_DFL)

    return subprocess.Popen(argv, preexec_fn=defaults, **options)
