"""A 3-master Redis Cluster whose masters clients reach only through a
:class:`~silent_network.SilentProxy` each, announced in the slot map as their address: a
master can go silent (a hung network) while the test reaches them all directly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import redis
from cluster_helpers import LocalRedisCluster
from silent_network import SilentProxy


@dataclass
class HiddenCluster:
    """A 3-master cluster whose masters the code under test reaches only through proxies."""

    cluster: LocalRedisCluster
    proxies: list[SilentProxy]

    @property
    def url(self) -> str:
        """The URL under test: the first master's proxy (the slot map names the others')."""
        return f"redis+cluster://127.0.0.1:{self.proxies[0].port}"

    def direct(self) -> redis.RedisCluster:
        """A client of the masters themselves (the worker's side: no proxy between)."""
        real = {p.port: port for p, port in zip(self.proxies, self.cluster.ports, strict=True)}
        return redis.RedisCluster(host="127.0.0.1", port=self.cluster.ports[0],
                                  address_remap=lambda a: (a[0], real.get(a[1], a[1])))  # fmt: skip

    def master_of(self, key: str) -> int:
        """The index of the master holding ``key``'s slot."""
        announced = self.cluster.owner(key)
        return next(i for i, p in enumerate(self.proxies) if p.port == announced)

    def another(self, key: str) -> int:
        """A master not holding ``key``'s slot, nor the one the URL names."""
        mine = self.master_of(key)
        return next(i for i in range(1, len(self.proxies)) if i != mine)

    @contextlib.contextmanager
    def fresh(self) -> Iterator[HiddenCluster]:
        """The cluster, flushed, every proxy passing; healed again afterwards."""
        for port in self.cluster.ports:
            with redis.Redis(port=port) as node:
                node.flushall()
        try:
            yield self
        finally:
            for proxy in self.proxies:
                proxy.heal()


@contextlib.contextmanager
def running_hidden_cluster() -> Iterator[HiddenCluster]:
    """A :class:`HiddenCluster` started, stopped at the end (for a module's fixture)."""
    cluster = LocalRedisCluster()
    proxies = [SilentProxy(port) for port in cluster.ports]
    try:
        cluster.start(announce=[p.port for p in proxies])
        yield HiddenCluster(cluster, proxies)
    finally:
        for proxy in proxies:
            proxy.close()
        cluster.stop()
