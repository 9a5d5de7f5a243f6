"""``batchfleet top`` and ``load-lora`` / ``unload-lora`` on a Redis Cluster whose masters
clients reach through proxies that can go silent (:mod:`hidden_cluster`): ``top`` keeps its
last tables, marked, while a master is silent and reads again once it answers (each read
bounded, not the cluster client's minute of tries); a control command waits for the
cluster's live generating worker, which loads the adapter and records it on the cluster;
an unreachable cluster is a message and exit 1 from each command, not a traceback."""

from __future__ import annotations

import io
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.model_info import decode_model_info
from conftest import TINY_LM_OPTIONS, WorkerProcess, fleet_toml
from gateway_fakes import ScriptedWorker
from hidden_cluster import HiddenCluster
from rich.console import Console, RenderableType

from batchfleet import cli
from batchfleet.redis_errors import FAILED_CALL
from batchfleet.redis_server import LocalRedis, free_port
from batchfleet.status import gather
from batchfleet.top import TopView

pytestmark = pytest.mark.timeout(240)

MODEL = "mm"
READ_S = 0.5
"""How long a read of ``top`` waits for a silent master here."""


@pytest.fixture
def no_fleet_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No fleet file or broker from the environment: a command has its arguments alone."""
    for name in ("BATCHFLEET_CONFIG", "BATCHFLEET_BROKER_URL", "REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return monkeypatch


def text(renderable: RenderableType) -> str:
    out = io.StringIO()
    Console(file=out, width=1000, color_system=None).print(renderable)
    return out.getvalue()


def cells(shown: str, first: str) -> list[list[str]]:
    """The rows of the tables in ``shown`` whose first cell is ``first``."""
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in shown.splitlines()]
    return [r for r in rows if r and r[0] == first]


def a_model_with_a_live_worker(hidden: HiddenCluster, model: str = MODEL) -> None:
    """``model``'s lanes and consumer group, one waiting request, its worker's heartbeat."""
    with hidden.direct() as client:
        worker = ScriptedWorker(client, model)
        worker.beat()
        client.xadd(ModelKeys(model).lane(0), {"json": "{}"})


@pytest.mark.parametrize("silent", ["its model's master", "the URL's master"])
def test_top_keeps_its_last_tables_while_a_master_is_silent_and_reads_again_after(
    silent: str, hidden: HiddenCluster
) -> None:
    # Given a model on the cluster (its keys on another master than the URL's, or on the
    # URL's), its worker live, one request waiting in lane 0
    apart = next(m for m in (f"m{i}" for i in range(50)) if hidden.master_of(f"{{{m}}}") != 0)
    model = apart if silent == "its model's master" else MODEL
    which = hidden.master_of(f"{{{model}}}") if silent == "its model's master" else 0
    a_model_with_a_live_worker(hidden, model)
    view = TopView(lambda: gather(hidden.url, [model], workers=False, socket_timeout=READ_S,
                                  retries=0), clock=lambda: 0.0)  # fmt: skip
    first = text(view.frame())
    lanes = [r[:5] for r in cells(first, model)]
    assert lanes[0][3:] == ["0", "1"] and cells(first, "w1") and "cannot read" not in first
    # When the master goes silent (a hung network): Then the next frame is the last tables,
    # marked, once one bounded read gave up (a timeout; the whole cluster unreachable where
    # the silent master is the one the URL names)
    hidden.proxies[which].silence()
    stale = text(view.frame())
    assert stale.startswith(first.rstrip("\n"))
    read_at = time.strftime("%H:%M:%S", time.localtime(0.0))  # (its clock)
    assert "cannot read Redis: " in stale and f"the tables are of {read_at}" in stale
    assert ("TimeoutError" if silent == "its model's master" else "Unreachable") in stale
    # When it answers again: Then the frame is read afresh, unmarked
    hidden.proxies[which].heal()
    fresh = text(view.frame())
    assert [r[:5] for r in cells(fresh, model)] == lanes and "cannot read" not in fresh


def test_top_s_first_read_failing_is_raised_and_the_command_says_so(
    hidden: HiddenCluster, no_fleet_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    a_model_with_a_live_worker(hidden)
    hidden.proxies[0].silence()
    view = TopView(lambda: gather(hidden.url, [MODEL], workers=False, socket_timeout=READ_S,
                                  retries=0))  # fmt: skip
    with pytest.raises(FAILED_CALL):
        view.frame()  # nothing read yet: nothing to show
    argv = ["top", "--redis-url", hidden.url, "-m", MODEL, "--timeout", str(READ_S)]
    assert cli.main(argv) == 1
    assert "cannot reach Redis: " in capsys.readouterr().err


def test_the_top_command_on_a_cluster_shows_the_model_and_its_worker(
    hidden: HiddenCluster, no_fleet_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    import batchfleet.top

    a_model_with_a_live_worker(hidden)
    refreshes: list[float] = []

    def refresh(seconds: float) -> None:  # the interval, in no time; Ctrl-C at the second
        refreshes.append(seconds)
        if len(refreshes) == 2:
            raise KeyboardInterrupt

    no_fleet_env.setattr(batchfleet.top.time, "sleep", refresh)
    assert cli.main(["top", "--redis-url", hidden.url, "-i", "0.25", "--timeout", "2"]) == 0
    out, err = capsys.readouterr()
    assert refreshes == [0.25, 0.25]
    assert cells(out, MODEL)[0][3:5] == ["0", "1"]  # lane 0: one request waits
    assert cells(out, "w1")
    assert "heartbeats alone" in err  # no broker given: the workers from Redis alone


@pytest.mark.parametrize("argv", [["status"], ["top"], ["load-lora", "gen", "x", "/a"],
                                  ["unload-lora", "gen", "x"], ["policy", "gen", "max_wait_ms=5"]])  # fmt: skip
def test_an_unreachable_cluster_is_said_and_exit_1_not_a_traceback(
    argv: list[str], no_fleet_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # no node listens there: redis-py's cluster client raises RedisClusterUnreachableError,
    # not a redis.RedisError
    port = free_port()
    no_fleet_env.setenv("BATCHFLEET_BROKER_URL", f"redis://127.0.0.1:{port}")
    assert cli.main([*argv, "--redis-url", f"redis+cluster://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach Redis: " in err or "cannot read the workers' heartbeats: " in err, err
    assert "Redis Cluster cannot be connected" in err


# --- load-lora: a real generating worker on the cluster ---------------------------------------


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_causal_lm

    return make_causal_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module")
def adapters(lm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("peft")
    from test_generation_lora import sql_and_chat

    return sql_and_chat(lm, tmp_path_factory.mktemp("adapters"))


def test_load_and_unload_lora_wait_for_the_cluster_s_live_worker_which_records_them(
    hidden: HiddenCluster, redis_server: LocalRedis, lm: Path, adapters: dict[str, Path],
    start_worker: Callable[..., WorkerProcess], tmp_path: Path,
    no_fleet_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from batchfleet.producer import Producer

    # Given a worker serving gen on the cluster with its adapter sql (Celery's broker: a
    # plain redis-server, as the fleet file says)
    spec = {"runner": "text-generation", "path": str(lm), "options": TINY_LM_OPTIONS}
    first, _, rest = fleet_toml(hidden.url, {"gen": spec}).partition("\n")
    fleet = (f'{first}\nbroker_url = "{redis_server.url}"\n{rest}'
             f'[models.gen.options.lora_adapters]\nsql = "{adapters["sql"]}"\n')  # fmt: skip
    config = tmp_path / "fleet.toml"
    config.write_text(fleet)
    direct = hidden.direct()
    start_worker(fleet, "gen-1").wait_ready(direct, "gen")
    keys = ModelKeys("gen")

    # When chat is loaded with `batchfleet load-lora`
    code = cli.main(["load-lora", "gen", "chat", str(adapters["chat"]), "--config", str(config),
                     "--timeout", "60"])  # fmt: skip
    out, err = capsys.readouterr()
    # Then the live worker, read on the cluster, was waited for and loaded it
    assert code == 0, out + err
    (line,) = out.splitlines()
    host, _, raw = line.partition(": ")
    assert host == f"gen-1@{socket.gethostname()}"
    reply = json.loads(raw)
    assert reply["lora_adapters"] == {"gen": ["sql", "chat"]} and "lora_error" not in reply
    # recorded on the cluster for workers started later (its directory absolute), and in
    # the model info a gateway reads
    assert direct.hgetall(keys.lora) == {b"chat": str(adapters["chat"]).encode()}
    assert decode_model_info(direct.get(keys.info) or b"").lora_adapters == ["sql", "chat"]
    # and a request naming it is served (its tokens are the adapter's: not the base model's)
    with Producer(hidden.url) as producer:
        runs = {lora: producer.submit("gen", inputs=["the man was"], lora=lora,
                                      max_new_tokens=6, ignore_eos=True, return_token_ids=True)
                for lora in (None, "chat")}  # fmt: skip
        tokens = {k: job.result(timeout=60).generations()[0].token_ids for k, job in runs.items()}
    assert tokens["chat"] and tokens["chat"] != tokens[None]

    # When sql is unloaded with `batchfleet unload-lora`, to the worker by its name
    code = cli.main(["unload-lora", "gen", "sql", "--config", str(config), "-d", "gen-1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out.split(": ", 1)[1])["lora_adapters"] == {"gen": ["chat"]}
    assert direct.hget(keys.lora, "sql") is not None  # its tombstone: not served later
    assert decode_model_info(direct.get(keys.info) or b"").lora_adapters == ["chat"]
    direct.close()
