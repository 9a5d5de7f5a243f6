"""``python -m batchfleet run-batch`` as a process, its stderr read as it comes, and the
requests it sends taken by a :class:`~gateway_fakes.ScriptedWorker`: each wait for an
event, with a hang guard far past it."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

from gateway_fakes import ScriptedWorker, Taken

from batchfleet.tied_process import tied_popen

GUARD_S = 60.0
"""How long a wait may last before the test calls it a hang (each ends far sooner)."""


class RunBatch:
    """``python -m batchfleet run-batch ...``; its stderr read line by line as it comes."""

    def __init__(self, redis_url: str, source: Path | str, target: Path | str, *flags: str) -> None:
        self.proc = tied_popen(
            [sys.executable, "-m", "batchfleet", "run-batch", "--redis-url", redis_url, "-i",
             str(source), "-o", str(target), *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str) -> str:
        """The first stderr line from here on matching ``pattern``."""
        while (line := self.lines.get(timeout=GUARD_S)) is not None:
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"it ended without {pattern!r}:\n{''.join(self.seen)}")

    def end(self, guard_s: float = GUARD_S) -> tuple[int, str]:
        """Its exit status and its whole stderr (``guard_s``: how long it may take to end)."""
        code = self.proc.wait(timeout=guard_s)
        while (line := self.lines.get(timeout=GUARD_S)) is not None:
            self.seen.append(line)
        return code, "".join(self.seen)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def take(fake: ScriptedWorker) -> Taken:
    """The next request the run sends (its start included: a process starting)."""
    for _ in range(int(GUARD_S / 10)):
        try:
            return fake.take()  # (waits 10 s)
        except ValueError:  # none yet
            continue
    raise AssertionError("no request came")
