"""LoRA adapters loaded and unloaded while the text-generation runner serves (vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``): read and checked off the
device thread, put in the engine between two steps; a request already started under an
unloaded adapter ends under it, a new one naming it is an ``invalid_request``;
``max_loras`` bounds them; ``bf_load_lora`` / ``bf_unload_lora`` through a real Celery
worker's remote control publish the model info again and record the adapter in
``bf:{model}:lora`` (absolute; unloaded ones too), which a worker started later loads (or
unloads); per-adapter gauges."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import urllib.request
import weakref
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from conftest import WorkerProcess
from devices import DEVICE
from test_generation_lora import (
    OPTIONS,
    PROMPTS,
    _reference,
    make_adapter,
    sql_and_chat,
    start_gen_worker,
)
from test_generation_runner import Driver, prepare, req
from tiny_models import make_causal_lm

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from batchfleet.producer import Producer  # noqa: E402
from batchfleet.schemas.errors import ErrorCode  # noqa: E402
from batchfleet.schemas.keys import ModelKeys  # noqa: E402
from batchfleet.schemas.messages import Limits  # noqa: E402
from batchfleet.schemas.model_info import decode_model_info  # noqa: E402
from batchfleet.worker.runner import PrepareError  # noqa: E402
from batchfleet.worker.runner_info import model_info  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402

from batchfleet.redis_server import free_port  # noqa: E402


@pytest.fixture(scope="module")
def adapters(lm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return sql_and_chat(lm, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


def _serving(lm: Path, startup: dict[str, Path] | None = None, **opts: Any) -> TextGenerationRunner:
    named = {k: str(v) for k, v in (startup or {}).items()}
    return TextGenerationRunner(lm, device=DEVICE, dtype="float32",
                                options=OPTIONS | {"lora_adapters": named} | opts)  # fmt: skip


def _tokens(d: Driver, key: str) -> list[int]:
    return list(d.finals[key].outputs[0]["token_ids"])


def _gen(key: str, prompt: int, n: int, lora: str | None = None) -> Any:
    return req(key, inputs=[PROMPTS[prompt]], max_new_tokens=n, lora=lora, ignore_eos=True,
               return_token_ids=True)  # fmt: skip


@pytest.mark.parametrize("forward", ["lean", "transformers"])
def test_an_adapter_loaded_between_steps_serves_the_merged_models_tokens(
    lm: Path, adapters: dict[str, Path], forward: str
) -> None:
    # Given: a runner with no adapter, a base request running
    runner = _serving(lm, lean_decode=forward == "lean")
    assert (runner.engine.lean is not None) == (forward == "lean")  # type: ignore[attr-defined]
    reference = _reference(lm, adapters, runner)
    d = Driver(runner)
    (p0,) = prepare(runner, _gen("r0", 0, 10))
    d.step([("r0", p0)])
    d.step()
    # When: sql is loaded while it runs, and requests name it from the next step on
    runner.load_lora("sql", adapters["sql"])
    assert runner.lora_adapters == ("sql",)
    assert model_info(runner, Limits(), 1).lora_adapters == ["sql"]
    p1, p2 = prepare(runner, _gen("r1", 1, 8, "sql"), _gen("r2", 2, 6, "sql"))
    d.step([("r1", p1)])
    runner.load_lora("chat", adapters["chat"])
    (p3,) = prepare(runner, _gen("r3", 3, 7, "chat"))
    d.step([("r2", p2), ("r3", p3)])
    d.run()
    # Then: each gives its own model's greedy tokens, the base one untouched
    assert _tokens(d, "r0") == reference(None, PROMPTS[0], 10)
    assert _tokens(d, "r1") == reference("sql", PROMPTS[1], 8) != reference(None, PROMPTS[1], 8)
    assert _tokens(d, "r2") == reference("sql", PROMPTS[2], 6)
    assert _tokens(d, "r3") == reference("chat", PROMPTS[3], 7)


def test_an_unloaded_adapter_s_running_request_ends_under_it_and_new_ones_are_invalid(
    lm: Path, adapters: dict[str, Path]
) -> None:
    runner = _serving(lm, adapters)
    reference = _reference(lm, adapters, runner)
    engine: Any = runner.engine
    d = Driver(runner)
    # Given: a request running under sql, another read (prepared) and not yet started
    running, read = prepare(runner, _gen("run", 2, 12, "sql"), _gen("read", 1, 4, "sql"))
    d.step([("run", running)])
    d.step()
    # When: sql is unloaded
    runner.unload_lora("sql")
    # Then: a new request naming it is an invalid request; the model info drops it
    (new,) = runner.prepare_many([_gen("new", 1, 4, "sql")])
    assert isinstance(new, PrepareError) and new.code == ErrorCode.INVALID_REQUEST
    assert "'sql'" in str(new) and "(chat)" in str(new)
    assert model_info(runner, Limits(), 1).lora_adapters == ["chat"]
    # the one read before the unload does not start: answered invalid_request when admitted
    d.step([("read", read)])
    assert d.failed["read"].code == ErrorCode.INVALID_REQUEST
    assert "'sql' was unloaded" in d.failed["read"].message
    # the running one ends under sql, its adapter kept in the engine until then
    assert engine.adapters[0] is not None
    d.run()
    assert _tokens(d, "run") == reference("sql", PROMPTS[2], 12)
    d.step()  # the step after its end takes sql's weights out of the engine
    assert engine.adapters[0] is None and engine.adapters[1] is not None
    assert not runner._loras.pending
    (again,) = runner.prepare_many([_gen("again", 1, 4, "sql")])
    assert isinstance(again, PrepareError)
    with pytest.raises(ValueError, match="'sql' is not loaded"):
        runner.unload_lora("sql")


def test_a_preempted_request_of_an_unloaded_adapter_resumes_under_it(
    lm: Path, adapters: dict[str, Path]
) -> None:
    runner = _serving(lm, adapters)
    reference = _reference(lm, adapters, runner)
    (p,) = prepare(runner, _gen("pre", 3, 10, "chat"))
    d = Driver(runner)
    d.step([("pre", p)])
    d.step()
    d.step(preempt=["pre"])
    runner.unload_lora("chat")
    d.step()
    d.step()  # parked: its adapter is kept meanwhile
    assert runner.engine.adapters[1] is not None  # type: ignore[attr-defined]
    d.step([("pre", p)])
    d.run()
    assert _tokens(d, "pre") == reference("chat", PROMPTS[3], 10)


def test_an_adapter_reloaded_under_its_name_is_served_fresh_with_no_cached_prefix_of_the_old(
    lm: Path, adapters: dict[str, Path]
) -> None:
    # the name comes back with other weights: the prefix cached under the old ones is not
    # the new one's (labels are never given twice)
    runner = _serving(lm, {"x": adapters["sql"]})
    reference = _reference(lm, adapters, runner)
    long = "there were many years of time and the man was a b c it what is this " * 2
    first = req("a", inputs=[long], max_new_tokens=4, lora="x", ignore_eos=True,
                return_token_ids=True)  # fmt: skip
    d = Driver(runner)
    d.step([("a", prepare(runner, first)[0])])
    d.run()
    runner.unload_lora("x")
    d.step()
    runner.load_lora("x", adapters["chat"])
    second = req("b", inputs=[long], max_new_tokens=4, lora="x", ignore_eos=True,
                 return_token_ids=True)  # fmt: skip
    d.step([("b", prepare(runner, second)[0])])
    d.run()
    assert _tokens(d, "b") == reference("chat", long, 4)
    assert d.finals["b"].outputs[0]["cached_tokens"] == 0


def test_a_bad_adapter_is_refused_and_changes_nothing(
    lm: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    runner = _serving(lm, {"sql": adapters["sql"]}, max_lora_rank=8)
    engine: Any = runner.engine
    before = engine.adapters
    with pytest.raises(ValueError, match=r"cannot read adapter_config\.json") as missing:
        runner.load_lora("bad", tmp_path / "nowhere")
    assert not str(missing.value).startswith("options.")
    wide = make_adapter(tmp_path / "wide", lm, r=16, seed=3)
    with pytest.raises(ValueError, match="rank 16 is over max_lora_rank 8"):
        runner.load_lora("bad", wide)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 2, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        runner.load_lora("bad", broken)
    with pytest.raises(ValueError, match="'sql' is already loaded"):
        runner.load_lora("sql", adapters["chat"])
    # nothing changed: names, engine, nothing pending for the device thread
    assert runner.lora_adapters == ("sql",) and engine.adapters is before
    assert not runner._loras.pending
    runner.load_lora("bad", adapters["chat"])  # the refused name is free again
    assert runner.lora_adapters == ("sql", "bad")


def test_max_loras_bounds_the_adapters_loaded(lm: Path, adapters: dict[str, Path]) -> None:
    runner = _serving(lm, {"sql": adapters["sql"]}, max_loras=2)
    runner.load_lora("chat", adapters["chat"])
    with pytest.raises(ValueError, match="2 adapters are loaded, max_loras 2"):
        runner.load_lora("third", adapters["sql"])
    runner.unload_lora("sql")
    runner.load_lora("third", adapters["sql"])
    assert runner.lora_adapters == ("chat", "third")
    assert runner.info()["lora_adapters"] == ["chat", "third"]
    assert runner.info()["max_loras"] == 2
    with pytest.raises(ValueError, match="over max_loras 1"):
        _serving(lm, adapters, max_loras=1)
    with pytest.raises(ValueError, match=r"options\.max_loras"):
        _serving(lm, max_loras=0)


def test_an_adapter_the_lean_forward_cannot_run_is_refused_while_it_serves(
    lm: Path, adapters: dict[str, Path]
) -> None:
    """Startup takes transformers' forwards for such an adapter; a lean engine already
    serving does not switch forwards: refused, with what to do."""
    runner = _serving(lm)
    engine: Any = runner.engine
    engine.model.model.layers[0].mlp.extra = torch.nn.Linear(64, 64, bias=False).to(DEVICE)
    path = adapters["sql"].parent / "extra"
    make_adapter(path, lm, r=2, targets=["up_proj"])  # then retargeted by hand
    from safetensors.torch import save_file

    save_file({f"base_model.model.model.layers.0.mlp.extra.lora_{w}.weight": torch.ones(shape)
               for w, shape in (("A", (2, 64)), ("B", (64, 2)))},
              str(path / "adapter_model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match="lean_decode false"):
        runner.load_lora("extra", path)
    assert runner.lora_adapters == () and engine.lean is not None


def _held(key: str, lora: str | None) -> Any:
    """A request its loop read and holds, as the loop's scheduler keeps it."""
    from batchfleet.batching.types import Waiting
    from batchfleet.schemas.messages import Request
    from batchfleet.worker.answers import Held
    from batchfleet.worker.runner import Prepared
    from batchfleet.worker.streams import Entry

    prep = Prepared(None, rows=1, tokens=4, prompts=(4,), max_new_tokens=8)
    request = Request(id=key, model="gen", inputs=["x"], max_new_tokens=8, lora=lora)
    return Held(Entry(0, key, {}), request, "msgpack", prep, Waiting(key, 0, 0.0, 4), 0.0)


def test_the_metrics_show_each_adapter_s_requests(lm: Path, adapters: dict[str, Path]) -> None:
    from batchfleet.batching.gen_types import GenPolicy
    from batchfleet.batching.generation import GenerationPolicy
    from batchfleet.worker.gen_scheduler import GenScheduler
    from batchfleet.worker.metrics import LoraCollector
    from prometheus_client import CollectorRegistry, generate_latest

    runner = _serving(lm, {"sql": adapters["sql"]})
    scheduler = GenScheduler(GenerationPolicy(GenPolicy(kv_cache_tokens=2048, page_size=16,
                                                        step_tokens=64, max_running=16)))  # fmt: skip
    registry = CollectorRegistry()
    registry.register(LoraCollector(lambda: [SimpleNamespace(model="gen", runner=runner,
                                                             scheduler=scheduler)]))  # fmt: skip
    d = Driver(runner)
    a, b, c = prepare(runner, _gen("a", 0, 8, "sql"), _gen("b", 1, 8, "sql"), _gen("c", 2, 8))
    d.step([("a", a), ("b", b), ("c", c)])
    d.step(preempt=["b"])
    runner.load_lora("chat", adapters["chat"])
    # the loop holds b (preempted: the runner counts it), and has read d, e and f, not
    # admitted yet (f: the base model's; g: an adapter not loaded here)
    for key, lora in (("b", "sql"), ("d", "sql"), ("e", "chat"), ("f", None), ("g", "x")):
        scheduler.admit(_held(key, lora))
    text = generate_latest(registry).decode()
    assert 'batchfleet_lora_requests_running{adapter="sql",model="gen"} 1.0' in text
    assert 'batchfleet_lora_requests_waiting{adapter="sql",model="gen"} 2.0' in text
    assert 'batchfleet_lora_requests_running{adapter="chat",model="gen"} 0.0' in text
    assert 'batchfleet_lora_requests_waiting{adapter="chat",model="gen"} 1.0' in text
    assert 'batchfleet_lora_adapters_loaded{model="gen"} 2.0' in text
    assert 'adapter="x"' not in text
    # the memory of each adapter in the engine (chat's from the step that takes it)
    from batchfleet.worker.generation.lora import nbytes

    def held(name: str, label: int) -> str:
        size = nbytes(runner.engine.adapters[label - 1])  # type: ignore[arg-type]
        return f'batchfleet_lora_adapter_bytes{{adapter="{name}",model="gen"}} {float(size)}'

    assert held("sql", 1) in text
    assert 'batchfleet_lora_adapter_bytes{adapter="chat"' not in text
    d.step()
    assert held("chat", 2) in generate_latest(registry).decode()
    scheduler.stop("d", "cancelled")
    text = generate_latest(registry).decode()
    assert 'batchfleet_lora_requests_waiting{adapter="sql",model="gen"} 1.0' in text
    runner.unload_lora("sql")
    text = generate_latest(registry).decode()
    assert 'lora_requests_running{adapter="sql"' not in text
    assert 'lora_requests_waiting{adapter="sql"' not in text
    assert 'batchfleet_lora_adapters_loaded{model="gen"} 1.0' in text
    # its weights stay while its request runs (a below)
    assert 'batchfleet_lora_adapter_bytes{adapter="sql",model="gen"}' in text


@pytest.mark.parametrize("forward", ["lean", "transformers"])
def test_an_unloaded_adapter_s_memory_goes_once_its_last_request_ends(
    lm: Path, adapters: dict[str, Path], forward: str
) -> None:
    from batchfleet.worker.generation.lora import nbytes
    from batchfleet.worker.metrics import LoraCollector
    from prometheus_client import CollectorRegistry, generate_latest

    # Given: sql loaded while serving, a request running under it
    runner = _serving(lm, lean_decode=forward == "lean")
    engine: Any = runner.engine
    registry = CollectorRegistry()
    registry.register(LoraCollector(lambda: [SimpleNamespace(model="gen", runner=runner)]))
    runner.load_lora("sql", adapters["sql"])
    d = Driver(runner)
    d.step([("a", prepare(runner, _gen("a", 0, 8, "sql"))[0])])
    adapter = engine.adapters[0]
    assert (adapter.fused is not None) == (forward == "lean")
    tensors = [t for u in adapter.modules.values() for t in u]
    tensors += [t for layer in adapter.fused or () for u in layer.values() for t in u]
    alive = [weakref.ref(t) for t in tensors]
    gauge = 'batchfleet_lora_adapter_bytes{adapter="sql",model="gen"}'
    assert f"{gauge} {float(nbytes(adapter))}" in generate_latest(registry).decode()
    del adapter, tensors
    # When: it is unloaded: its weights stay while its request runs, then go
    runner.unload_lora("sql")
    d.step()
    gc.collect()
    assert all(r() is not None for r in alive)
    assert gauge in generate_latest(registry).decode()
    d.run()
    d.step()
    gc.collect()
    # Then: nothing holds any of its tensors; the gauge has no series for it
    assert engine.adapters == ()
    assert [r for r in alive if r() is not None] == []
    assert gauge not in generate_latest(registry).decode()


def _control(redis_url: str, dest: str, command: str, **arguments: str) -> dict[str, Any]:
    from celery import Celery

    app = Celery("t", broker=redis_url, set_as_current=False)
    try:
        replies = app.control.broadcast(command, arguments=arguments, destination=[dest],
                                        reply=True, timeout=30, limit=1)  # fmt: skip
    finally:
        app.close()
    assert replies, f"no reply to {command}"
    reply: dict[str, Any] = replies[0][dest]
    return reply


def test_adapters_are_loaded_and_unloaded_through_a_worker_s_remote_control(
    redis_url: str, r: redis.Redis, lm: Path, adapters: dict[str, Path], tmp_path: Path,
    start_worker: Callable[..., WorkerProcess], capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from batchfleet.status import gather

    port = free_port()
    start_gen_worker(redis_url, r, lm, adapters["sql"], start_worker,
                     f'[metrics]\nport = {port}\naddress = "127.0.0.1"\n')  # fmt: skip
    dest = f"gen-1@{socket.gethostname()}"
    info = lambda: decode_model_info(r.get(ModelKeys("gen").info) or b"")  # noqa: E731
    assert info().lora_adapters == ["sql"]
    reference = _reference(lm, adapters, _serving(lm))

    # When: chat is loaded through plain `celery control`
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "batchfleet.worker.app", "control",
         "bf_load_lora", "gen", "chat", str(adapters["chat"]), "--timeout", "30", "-d", dest],
        env=dict(os.environ, REDIS_URL=redis_url), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # Then: the worker answers for itself, the model info lists it, requests take it
    assert out.returncode == 0 and f"{dest}: OK" in out.stdout, out
    assert "load_lora chat: gen serves sql, chat" in out.stdout, out.stdout
    assert info().lora_adapters == ["sql", "chat"]
    assert gather(redis_url, ["gen"], workers=False).to_json()["models"][0]["lora_adapters"] == [
        "sql",
        "chat",
    ]
    with Producer(redis_url) as producer:
        job = producer.submit("gen", inputs=[PROMPTS[1]], lora="chat", max_new_tokens=6,
                              ignore_eos=True, return_token_ids=True)  # fmt: skip
        (out,) = job.result(timeout=60).generations()
        assert out.token_ids == reference("chat", PROMPTS[1], 6)
    # a bad directory: the reply says why, nothing changes
    bad = _control(redis_url, dest, "bf_load_lora", model="gen", name="bad",
                   path=str(tmp_path / "nowhere"))  # fmt: skip
    assert "gen: adapter 'bad'" in bad["error"] and "adapter_config.json" in bad["error"]
    assert bad["code"] == "refused"
    assert info().lora_adapters == ["sql", "chat"]
    from celery import Celery

    app = Celery("t", broker=redis_url, set_as_current=False)
    try:
        state = app.control.inspect(timeout=10, destination=[dest])._request("bf_state") or {}
    finally:
        app.close()
    assert state[dest]["gen"]["runner"]["lora_adapters"] == ["sql", "chat"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert 'batchfleet_lora_adapters_loaded{model="gen"} 2.0' in metrics
    assert 'batchfleet_lora_requests_running{adapter="chat",model="gen"} 0.0' in metrics

    # When: sql is unloaded (`batchfleet unload-lora`)
    from batchfleet import cli

    capsys.readouterr()
    assert cli.main(["unload-lora", "gen", "sql", "--redis-url", redis_url, "-d", dest,
                     "--timeout", "10"]) == 0  # fmt: skip
    reply = json.loads(capsys.readouterr().out.split(": ", 1)[1])
    # its name in the model's heartbeats, by which the gateway knows who replied
    assert reply.pop("consumer") in {k.decode() for k in r.hkeys(ModelKeys("gen").workers)}
    assert reply == {"ok": "unload_lora sql: gen serves chat", "models": ["gen"],
                     "lora_adapters": {"gen": ["chat"]}}  # fmt: skip
    assert info().lora_adapters == ["chat"]
    with Producer(redis_url) as producer:
        res = producer.submit("gen", inputs=[PROMPTS[1]], lora="sql").result(timeout=60)
        assert res.error is not None and res.error.code == ErrorCode.INVALID_REQUEST
    unknown = _control(redis_url, dest, "bf_unload_lora", model="gen", name="sql")
    assert "'sql' is not loaded" in unknown["error"] and unknown["code"] == "not_loaded"
    assert cli.main(["load-lora", "gen", "x", str(tmp_path), "--redis-url", redis_url,
                     "-d", dest]) == 1  # refused: exit 1  # fmt: skip


def test_the_info_published_again_is_also_what_the_intake_publishes_on_a_reconnect(
    lm: Path, adapters: dict[str, Path]
) -> None:
    from batchfleet.worker.control import publish_info

    runner = _serving(lm)
    runner.load_lora("sql", adapters["sql"])
    published: list[Any] = []
    from batchfleet.config import ModelConfig

    config = ModelConfig.model_validate({"runner": "text-generation", "path": str(lm)})
    loop = SimpleNamespace(runner=runner, config=config,
                           parts=SimpleNamespace(source=SimpleNamespace(info=None)),
                           streams=SimpleNamespace(publish_info=published.append))  # fmt: skip
    publish_info(loop)  # type: ignore[arg-type]
    assert published[0].lora_adapters == ["sql"] and loop.parts.source.info is published[0]
    assert published[0].config_hash == config.serving_hash(published[0].version)


# --- adapters loaded while serving are fleet-wide state (bf:{model}:lora) ------------------


def _started(r: redis.Redis, lm: Path, startup: dict[str, Path] | None = None,
             **opts: Any) -> tuple[TextGenerationRunner, Any]:  # fmt: skip
    """A runner as a worker starting now makes it: its parts restore ``bf:{gen}:lora``;
    the runner and the info its intake publishes."""
    from batchfleet.worker.observers import Observers
    from batchfleet.worker.parts import redis_parts
    from batchfleet.worker.streams import ModelStreams

    from batchfleet.config import ModelConfig, WorkerConfig

    runner = _serving(lm, startup, **opts)
    config = ModelConfig.model_validate({"runner": "text-generation", "path": str(lm)})
    parts = redis_parts(ModelStreams(r, "gen", config.lanes, "later"), runner, config,
                        WorkerConfig(), Observers([]), "gen")  # fmt: skip
    return runner, parts.source.info  # type: ignore[attr-defined]


def test_a_worker_started_later_loads_the_adapters_loaded_while_serving(
    r: redis.Redis, lm: Path, adapters: dict[str, Path], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    keys = ModelKeys("gen")
    r.hset(keys.lora, mapping={"chat": str(adapters["chat"]), "sql": str(adapters["chat"]),
                               "gone": str(tmp_path / "nowhere")})  # fmt: skip
    reference = _reference(lm, adapters, _serving(lm))
    # Given: the fleet file's sql (whose name the hash also has, with chat's weights)
    with caplog.at_level("WARNING"):
        runner, info = _started(r, lm, {"sql": adapters["sql"]})
    # Then: chat loaded besides, sql is the fleet file's, the missing one skipped
    assert runner.lora_adapters == ("sql", "chat")
    assert info.lora_adapters == ["sql", "chat"]
    assert "'gone'" in caplog.text and "skipped" in caplog.text
    d = Driver(runner)
    a, b, c = prepare(runner, _gen("a", 0, 6, "chat"), _gen("b", 1, 6, "sql"), _gen("c", 2, 6))
    d.step([("a", a), ("b", b), ("c", c)])
    d.run()
    assert _tokens(d, "a") == reference("chat", PROMPTS[0], 6)
    assert _tokens(d, "b") == reference("sql", PROMPTS[1], 6)
    assert _tokens(d, "c") == reference(None, PROMPTS[2], 6)


def test_max_loras_bounds_the_adapters_a_worker_started_later_loads(
    r: redis.Redis, lm: Path, adapters: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    r.hset(ModelKeys("gen").lora, mapping={"chat": str(adapters["chat"]),
                                            "more": str(adapters["sql"])})  # fmt: skip
    with caplog.at_level("WARNING"):
        runner, info = _started(r, lm, {"sql": adapters["sql"]}, max_loras=2)
    assert runner.lora_adapters == ("sql", "chat") and info.lora_adapters == ["sql", "chat"]
    assert "'more'" in caplog.text and "max_loras 2" in caplog.text


def test_a_worker_started_later_serves_what_was_loaded_and_not_what_was_unloaded(
    redis_url: str, r: redis.Redis, lm: Path, adapters: dict[str, Path],
    start_worker: Callable[..., WorkerProcess],
) -> None:  # fmt: skip
    host = socket.gethostname()
    keys = ModelKeys("gen")
    start_gen_worker(redis_url, r, lm, adapters["sql"], start_worker)
    reference = _reference(lm, adapters, _serving(lm))
    # When: chat is loaded while gen-1 serves, by a path relative to gen-1's directory
    # (the test's, as it started gen-1)
    relative = os.path.relpath(adapters["chat"])
    loaded = _control(redis_url, f"gen-1@{host}", "bf_load_lora", model="gen", name="chat",
                      path=relative)  # fmt: skip
    assert "lora_error" not in loaded and loaded["lora_adapters"] == {"gen": ["sql", "chat"]}
    # Then: it is recorded absolute (a worker elsewhere reads the same directory)
    assert loaded["path"] == os.path.abspath(relative) and os.path.isabs(loaded["path"])
    assert r.hgetall(keys.lora) == {b"chat": os.path.abspath(relative).encode()}
    # Then: gen-2, started afterwards (gen-1 paused: gen-2 answers), serves it and lists it
    start_gen_worker(redis_url, r, lm, adapters["sql"], start_worker, name="gen-2")
    assert decode_model_info(r.get(keys.info) or b"").lora_adapters == ["sql", "chat"]
    assert _control(redis_url, f"gen-1@{host}", "bf_pause", model="gen")["models"] == ["gen"]
    with Producer(redis_url) as producer:
        job = producer.submit("gen", inputs=[PROMPTS[1]], lora="chat", max_new_tokens=6,
                              ignore_eos=True, return_token_ids=True)  # fmt: skip
        (out,) = job.result(timeout=60).generations()
        assert out.token_ids == reference("chat", PROMPTS[1], 6)
    # When: chat is unloaded: recorded unloaded; a runner started now does not load it
    for dest in ("gen-1", "gen-2"):
        reply = _control(redis_url, f"{dest}@{host}", "bf_unload_lora", model="gen", name="chat")
        assert reply["lora_adapters"] == {"gen": ["sql"]}, reply
    assert r.hgetall(keys.lora) == {b"chat": b""}  # recorded unloaded
    runner, info = _started(r, lm, {"sql": adapters["sql"]})
    assert runner.lora_adapters == ("sql",) and info.lora_adapters == ["sql"]
    # When: sql, of the fleet file, is unloaded: a worker started now does not serve it
    for dest in ("gen-1", "gen-2"):
        reply = _control(redis_url, f"{dest}@{host}", "bf_unload_lora", model="gen", name="sql")
        assert reply["lora_adapters"] == {"gen": []}, reply
    assert r.hgetall(keys.lora) == {b"chat": b"", b"sql": b""}
    runner, info = _started(r, lm, {"sql": adapters["sql"]})
    assert runner.lora_adapters == () and info.lora_adapters == []
    with Producer(redis_url) as producer:
        res = producer.submit("gen", inputs=[PROMPTS[1]], lora="sql").result(timeout=60)
        assert res.error is not None and res.error.code == ErrorCode.INVALID_REQUEST
    # When: loaded again (by gen-2): recorded loaded, and a worker started now serves it
    reply = _control(redis_url, f"gen-2@{host}", "bf_load_lora", model="gen", name="sql",
                     path=str(adapters["sql"]))  # fmt: skip
    assert reply["lora_adapters"] == {"gen": ["sql"]}, reply
    assert r.hget(keys.lora, "sql") == str(adapters["sql"]).encode()
    runner, info = _started(r, lm, {"sql": adapters["sql"]})
    assert runner.lora_adapters == ("sql",) and info.lora_adapters == ["sql"]


def test_a_fleet_file_s_adapter_unloaded_while_serving_is_unloaded_by_a_worker_started_later(
    r: redis.Redis, lm: Path, adapters: dict[str, Path]
) -> None:
    from batchfleet.worker.streams import ModelStreams

    # Given: sql and chat unloaded while serving (sql of the fleet file, chat not)
    streams = ModelStreams(r, "gen", 3, "w")
    streams.lora_loaded("chat", str(adapters["chat"]))
    streams.lora_unloaded("chat")
    streams.lora_unloaded("sql")
    assert streams.loras() == {"chat": None, "sql": None}
    # Then: a worker started now serves neither, and serves the base model
    runner, info = _started(r, lm, {"sql": adapters["sql"]})
    assert runner.lora_adapters == () and info.lora_adapters == []
    reference = _reference(lm, adapters, _serving(lm))
    d = Driver(runner)
    (a,) = prepare(runner, _gen("a", 0, 6))
    d.step([("a", a)])
    d.run()
    assert _tokens(d, "a") == reference(None, PROMPTS[0], 6)
    assert not runner._loras.pending
