"""The counting connection pool (``batchfleet/drops.py``) on the ``rediss://`` (TLS) path:
a TLS URL picks redis-py's SSL connection, counted, for a plain client, a cluster
client's every node, and the asyncio client's pool; over a real TLS server (Debian's
``redis-server`` is built with TLS; the bundled Valkey is not: those tests skip there) a
connection the server drops is counted in :data:`DROPS` and the call retried on a new
TLS connection. Certificates from ``trustme``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import trustme
from redis.connection import SSLConnection, UnixDomainSocketConnection

from batchfleet.connection import connect, connect_async, is_cluster_url, plain_url
from batchfleet.drops import DROPS, CountingPool
from batchfleet.redis_server import LocalRedis, find_server, free_port

pytestmark = pytest.mark.timeout(60)


def _counted(pool: object) -> bool:
    """Whether ``pool`` is a :class:`CountingPool` whose connections count their closes."""
    from batchfleet.drops import _Counting

    return isinstance(pool, CountingPool) and issubclass(pool.connection_class, _Counting)


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("rediss://u:p@cache.example:6380/0?ssl_ca_certs=/ca.pem", SSLConnection),
        ("redis://cache.example:6379/0", redis.Connection),
        ("unix:///run/redis.sock", UnixDomainSocketConnection),
    ],
)
def test_the_url_s_scheme_picks_the_counted_connection(url: str, base: type) -> None:
    pool = CountingPool.from_url(url)  # (no connection made)
    assert _counted(pool) and issubclass(pool.connection_class, base)
    is_tls = issubclass(pool.connection_class, SSLConnection)
    assert is_tls == url.startswith("rediss://")
    if is_tls:
        assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
        assert pool.connection_kwargs["username"] == "u"


def test_a_tls_cluster_url_is_a_cluster_url_of_rediss() -> None:
    url = "rediss+cluster://u:p@node.example:7000?ssl_ca_certs=/ca.pem"
    assert is_cluster_url(url)
    assert plain_url(url) == "rediss://u:p@node.example:7000?ssl_ca_certs=/ca.pem"
    assert not is_cluster_url("rediss://node.example:7000")


def test_the_asyncio_client_of_a_rediss_url_connects_over_ssl() -> None:
    client = connect_async("rediss://cache.example:6380/0?ssl_ca_certs=/ca.pem")
    assert isinstance(client, aioredis.Redis)
    pool = client.connection_pool
    assert issubclass(pool.connection_class, aioredis.SSLConnection)
    assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"


@dataclass(frozen=True)
class TlsServer:
    port: int
    ca: Path

    def url(self, scheme: str = "rediss") -> str:
        return f"{scheme}://127.0.0.1:{self.port}?ssl_ca_certs={self.ca}"

    def admin(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, ssl=True, ssl_ca_certs=str(self.ca))


@contextlib.contextmanager
def tls_server(where: Path, *, cluster: bool) -> Iterator[TlsServer]:
    """A TLS-only server of the PATH's Redis (its plain port off); a one-node cluster
    holding every slot with ``cluster``."""
    if not find_server().tls:
        pytest.skip(f"{find_server().server} is built without TLS")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file, ca_file = where / "key.pem", where / "cert.pem", where / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    port = free_port()
    args = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert_file),
            "--tls-key-file", str(key_file), "--tls-ca-cert-file", str(ca_file),
            "--tls-auth-clients", "no"]  # fmt: skip
    if cluster:
        args += ["--cluster-enabled", "yes", "--tls-cluster", "yes",
                 "--cluster-port", str(free_port()),
                 "--cluster-config-file", str(where / "nodes.conf")]  # fmt: skip
    server = LocalRedis(port, extra_args=args)
    server.start()
    found = TlsServer(port, ca_file)
    try:
        with found.admin() as admin:
            _ready(admin, server)
            if cluster:
                admin.execute_command("CLUSTER ADDSLOTSRANGE", 0, 16383)
                _ready(admin, server, lambda: admin.cluster("info")["cluster_state"] == "ok")
        yield found
    finally:
        server.stop()


def _ready(admin: redis.Redis, server: LocalRedis, done: object = None) -> None:
    """Poll until the server answers over TLS (and ``done()``, where given)."""
    end = time.monotonic() + 20
    while True:
        assert server.process is not None and server.process.poll() is None, "server exited"
        with contextlib.suppress(redis.ConnectionError):
            if admin.ping() and (done is None or done()):  # type: ignore[operator]
                return
        assert time.monotonic() < end, "the TLS server never became ready"
        time.sleep(0.05)


def _drop(admin: redis.Redis, client_id: int) -> None:
    """The server closes the connection of ``client_id``."""
    assert admin.client_kill_filter(_id=client_id) == 1


def test_a_tls_connection_dropped_is_counted_and_the_call_retried(tmp_path: Path) -> None:
    with tls_server(tmp_path, cluster=False) as server, server.admin() as admin:
        # Given a client of the rediss:// URL, over TLS
        client = connect(server.url())
        assert _counted(client.connection_pool)
        assert issubclass(client.connection_pool.connection_class, SSLConnection)
        client.set("k", "v")
        # When the server drops its connection
        before = DROPS.value
        _drop(admin, client.client_id())
        # Then the next call is answered on a new TLS connection, the drop counted
        assert client.get("k") == b"v"
        assert DROPS.value > before
        client.close()


def test_a_tls_cluster_node_s_dropped_connection_is_counted(tmp_path: Path) -> None:
    with tls_server(tmp_path, cluster=True) as server, server.admin() as admin:
        # Given a cluster client of the rediss+cluster:// URL
        client = connect(server.url("rediss+cluster"))
        assert isinstance(client, redis.RedisCluster)
        (node,) = client.get_nodes()
        pool = node.redis_connection.connection_pool
        assert _counted(pool) and issubclass(pool.connection_class, SSLConnection)
        client.set("k{m}", "v")
        # When the server drops the node's connection
        before = DROPS.value
        _drop(admin, node.redis_connection.client_id())  # (its pool's one connection)
        # Then the next call is answered anew, the drop counted
        assert client.get("k{m}") == b"v"
        assert DROPS.value > before
        client.close()
