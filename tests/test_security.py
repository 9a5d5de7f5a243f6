"""Least-privilege ACL users from deploy/redis/users.acl, and TLS (rediss://)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.keys import ModelKeys
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runners.embedding import EmbeddingRunner

from batchfleet.config import ModelConfig, WorkerConfig
from batchfleet.redis_server import LocalRedis, find_server, free_port
from batchfleet.tied_process import tied_popen

ACL_FILE = Path(__file__).parents[1] / "deploy" / "redis" / "users.acl"
KEYS = ModelKeys("tiny")


def _apply_acl(admin: redis.Redis) -> dict[str, str]:
    """Create the users of the shipped ACL file (keeping `default` on for the admin)."""
    secrets = {}
    for line in ACL_FILE.read_text().splitlines():
        if not line.startswith("user ") or line.startswith("user default"):
            continue
        words = shlex.split(line.replace("(", " ( ").replace(")", " ) "))
        name = words[1]
        secrets[name] = f"s3cret-{name}"
        rules, selector = [], None
        for w in words[2:]:
            w = w.replace(f"CHANGE_ME_{name}", secrets[name])
            if w == "(":
                selector = []
            elif w == ")":
                rules.append("(" + " ".join(selector or []) + ")")
                selector = None
            elif selector is not None:
                selector.append(w)
            else:
                rules.append(w)
        admin.execute_command("ACL", "SETUSER", name, "reset", *rules)
    return secrets


@pytest.fixture
def acl_url(redis_server: LocalRedis, r: redis.Redis) -> Iterator[dict[str, str]]:
    if int(r.info("server")["redis_version"].split(".")[0]) < 7:
        pytest.skip("the shipped ACL file uses Redis 7 selectors")
    secrets = _apply_acl(r)
    yield {n: f"redis://{n}:{s}@127.0.0.1:{redis_server.port}/0" for n, s in secrets.items()}
    for name in secrets:
        r.execute_command("ACL", "DELUSER", name)


def test_producer_and_worker_users(acl_url: dict[str, str], tiny_embedder: Path) -> None:
    worker_client = redis.Redis.from_url(acl_url["worker"])
    handler = EmbeddingRunner(tiny_embedder, device="cpu", max_tokens=32)
    loop = BatchLoop(
        "tiny", ModelConfig(path="/unused", max_tokens=32), handler, worker_client,
        consumer="acl-worker", worker=WorkerConfig(block_ms=20), burst=True,
    )  # fmt: skip
    loop.streams.ensure_groups()
    with Producer(acl_url["producer"]) as producer:
        jobs = producer.submit_many("tiny", ["the dog", "the fox"], priority=1)
        loop.run()
        assert [j.result(timeout=5).status for j in jobs] == ["ok", "ok"]
        assert list(producer.results(jobs, timeout=5))  # subscribe is allowed on its channel
        # what a producer must not do
        for command in (
            ("XREADGROUP", "GROUP", "workers", "x", "STREAMS", KEYS.lane(1), ">"),
            ("DEL", KEYS.result(jobs[0].id)),
            ("SET", KEYS.result("forged"), "x"),
            ("FLUSHALL",),
            ("KEYS", "*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                producer.client.execute_command(*command)
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker_client.execute_command("FLUSHALL")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    binaries = find_server()
    if not binaries.tls:
        pytest.skip(
            f"{binaries.server} ({binaries.kind}) is built without TLS: "
            "put a redis-server with TLS on PATH to run this test"
        )
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    server = tied_popen(
        [binaries.server, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
         "--tls-auth-clients", "no", "--save", "", "--dir", str(d)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        client = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if server.poll() is not None:
                    pytest.skip(f"redis-server without TLS: {server.stderr.read().decode()[:200]}")
                import time

                time.sleep(0.05)
        yield url, cert
    finally:
        server.terminate()
        server.wait()


def test_rediss_end_to_end(tls_redis: tuple[str, Path], tiny_embedder: Path) -> None:
    url, _ = tls_redis
    handler = EmbeddingRunner(tiny_embedder, device="cpu", max_tokens=32)
    from batchfleet.connection import connect

    loop = BatchLoop(
        "tiny", ModelConfig(path="/unused", max_tokens=32), handler, connect(url),
        consumer="tls-worker", worker=WorkerConfig(block_ms=20), burst=True,
    )  # fmt: skip
    with Producer(url) as producer:
        job = producer.submit("tiny", "the dog over TLS")
        loop.run()
        assert job.result(timeout=5).ok
    plain = url.replace("rediss://", "redis://").split("?")[0]
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(plain, socket_timeout=2).ping()
