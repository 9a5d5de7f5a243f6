"""A 3-master Redis Cluster with a replica per master on loopback, and the failover a test
inflicts on it: a master killed (``kill -9``), optionally after its replication link was
cut (the replica stopped, ``SIGSTOP``, and its connection closed by the master: the writes
the master acknowledges meanwhile are lost with it, as asynchronous replication loses
them), then the replica promoted.

Waits poll the cluster's own view (``CLUSTER SLOTS``, ``cluster_state``), never a fixed
sleep."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
from cluster_helpers import LocalRedisCluster
from conftest import fleet_toml

NODE_TIMEOUT_MS = 1000
"""``cluster-node-timeout``: a dead master is failed over about 1-2 s after its death."""


def _poll(done: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.05)


def _info(port: int, section: str) -> dict[str, object]:
    with redis.Redis(port=port, socket_timeout=2) as node:
        return node.info(section)  # type: ignore[no-any-return]


def _cluster_ok(port: int) -> bool:
    with redis.Redis(port=port, socket_timeout=2) as node:
        return bool(node.cluster("info").get("cluster_state") == "ok")


@dataclass
class Failover:
    """What a failover did: the master killed and the replica that took its slots."""

    dead: int
    heir: int


class FailoverCluster:
    """Six nodes: three masters and a replica of each (``--cluster-replicas 1``)."""

    def __init__(self) -> None:
        self.nodes = LocalRedisCluster(replicas=1, node_timeout_ms=NODE_TIMEOUT_MS)
        self.dead: set[int] = set()

    def start(self, timeout: float = 60.0) -> None:
        """Start and join the nodes; return once every node sees each master's replica and
        every replica is in sync."""
        self.nodes.start(timeout=timeout)
        for port in self.nodes.ports:
            _poll(lambda p=port: self._complete(p), timeout, f"node {port}: replicas unseen")  # type: ignore[misc]
            _poll(lambda p=port: self._synced(p), timeout, f"node {port} never synced")  # type: ignore[misc]

    def url_for(self, key: str) -> str:
        """A URL naming a node that a failover of ``key``'s master leaves alone and
        running: the replica of another master."""
        mine = self.owner(key)
        other = next(int(s[2][1]) for s in self._slots() if int(s[2][1]) != mine)  # type: ignore[index]
        return f"redis+cluster://127.0.0.1:{self.replica_of(other)}"

    def _complete(self, port: int) -> bool:
        with redis.Redis(port=port, socket_timeout=2) as node:
            slots = node.execute_command("CLUSTER SLOTS")
        return len(slots) == 3 and all(len(s) >= 4 for s in slots)

    def _synced(self, port: int) -> bool:
        info = _info(port, "replication")
        return info["role"] == "master" or info.get("master_link_status") == "up"

    def live(self) -> list[int]:
        return [p for p in self.nodes.ports if p not in self.dead]

    def _slots(self) -> list[list[object]]:
        with redis.Redis(port=self.live()[0], socket_timeout=2) as node:
            return node.execute_command("CLUSTER SLOTS")  # type: ignore[no-any-return]

    def owner(self, key: str) -> int:
        """The port of the master holding ``key``'s slot, as a live node sees it."""
        with redis.Redis(port=self.live()[0], socket_timeout=2) as node:
            slot = int(node.execute_command("CLUSTER KEYSLOT", key))
        for start, stop, master, *_ in self._slots():
            if start <= slot <= stop:  # type: ignore[operator]
                return int(master[1])  # type: ignore[index]
        raise LookupError(f"no master owns the slot of {key}")

    def replica_of(self, master: int) -> int:
        """The port of ``master``'s replica."""
        for _start, _stop, owner, *replicas in self._slots():
            if int(owner[1]) == master and replicas:  # type: ignore[index]
                return int(replicas[0][1])  # type: ignore[index]
        raise LookupError(f"master {master} has no replica")

    def process(self, port: int) -> subprocess.Popen[bytes]:
        return self.nodes.processes[self.nodes.ports.index(port)]

    def kill_master_of(
        self,
        key: str,
        *,
        cut_replica: Callable[[], None] | None = None,
        while_dead: Callable[[], None] | None = None,
    ) -> Failover:
        """``kill -9`` the master of ``key``'s slot. With ``cut_replica``: its replica is
        stopped and cut off first, then ``cut_replica()`` called, so what Redis
        acknowledges meanwhile never reaches the replica; it resumes after the kill and
        ``while_dead()`` (no replica can take the slot before). Returns at once: the slot
        map names the dead master until :meth:`promoted`."""
        dead = self.owner(key)
        heir = self.replica_of(dead)
        if cut_replica is not None:
            os.kill(self.process(heir).pid, signal.SIGSTOP)
            try:  # (stopped, it cannot reconnect: the replication stream ends here)
                with redis.Redis(port=dead) as master:
                    master.client_kill_filter(_type="replica")
                cut_replica()
            finally:
                self.process(dead).kill()
                try:
                    if while_dead is not None:
                        while_dead()
                finally:
                    os.kill(self.process(heir).pid, signal.SIGCONT)
        else:
            self.process(dead).kill()
        self.process(dead).wait()
        self.dead.add(dead)
        return Failover(dead, heir)

    def promoted(self, failover: Failover, key: str) -> None:
        """Return once the heir is a master holding ``key``'s slot and every live node
        sees the cluster ``ok``."""
        heir = failover.heir
        _poll(lambda: _info(heir, "replication")["role"] == "master", 30, "never promoted")
        _poll(lambda: self.owner(key) == heir, 30, f"{heir} never took the slot of {key}")
        _poll(lambda: all(_cluster_ok(p) for p in self.live()), 30, "cluster never ok")

    def stop(self) -> None:
        for port in self.nodes.ports:  # a replica stopped by a failed test ends too
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process(port).pid, signal.SIGCONT)
        self.nodes.stop()


@contextlib.contextmanager
def running_failover_cluster() -> Iterator[FailoverCluster]:
    """A :class:`FailoverCluster` started, stopped at the end (for a test's fixture)."""
    cluster = FailoverCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def fleet_file(path: Path, url: str, broker_url: str, models: dict[str, dict[str, object]]) -> Path:
    """A fleet file serving ``models`` from the cluster at ``url``, written to ``path``: its
    Celery broker a plain Redis (``broker_url``), ``claim_idle_ms`` far above a test's run
    (a request whose answer a failover lost is answered again by its live worker, not by
    that fallback)."""
    first, _, rest = fleet_toml(url, models, {"claim_idle_ms": 600_000}).partition("\n")
    path.write_text(f'{first}\nbroker_url = "{broker_url}"\n{rest}')
    return path
