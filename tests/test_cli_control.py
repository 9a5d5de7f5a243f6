"""The CLI's control commands (``pause`` … ``load-lora``, ``unload-lora``) wait for each
live worker of the model (its heartbeat), as the gateway's routes do: the wait ends once
each replied, one that did not reply in time is named and the exit code says so, and
``-d`` reaches the workers it names without a ping first. The broadcast is scripted
(``broker_fakes``: no Celery worker, no clock); the heartbeats are a real Redis's."""

from __future__ import annotations

import pytest
import redis
from batchfleet.schemas.keys import MODELS_KEY, ModelKeys
from broker_fakes import scripted_broker
from kombu.matcher import match

from batchfleet import cli
from batchfleet.control_wait import HEARTBEAT_WINDOW_MS, addressed, named
from batchfleet.remote import destination_pattern, replied_as

LOADED = {"ok": "load_lora x: gen serves x", "models": ["gen"], "lora_adapters": {"gen": ["x"]}}
OTHER = {"ok": "no loop for 'gen' here", "models": []}


def beats(r: redis.Redis, model: str, *names: str, stale: tuple[str, ...] = ()) -> None:
    """Heartbeats of ``names`` now, and of ``stale`` past the window (taken for dead)."""
    seconds, _ = r.time()
    now = seconds * 1000
    r.sadd(MODELS_KEY, model)
    r.hset(ModelKeys(model).workers, mapping={**{n: now for n in names},
                                              **{n: now - 2 * HEARTBEAT_WINDOW_MS for n in stale}})  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], redis_url: str, *argv: str) -> tuple[int, str, str]:
    code = cli.main([*argv, "--redis-url", redis_url])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_live_worker_that_does_not_reply_is_named_and_the_exit_code_says_so(
    redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # Given two live workers of gen (w2 busy: no reply comes from it), a dead one, and a
    # worker of another model
    beats(r, "gen", "w1", "w2", stale=("gone",))
    beats(r, "enc", "e1")
    broker = scripted_broker(monkeypatch, {"w1@h": LOADED | {"consumer": "w1"}}, {"e1@h": OTHER})
    # When an adapter is loaded
    code, out, err = run(capsys, redis_url, "load-lora", "gen", "x", "/a", "--timeout", "7")
    # Then the command went to every worker, waiting 7 s for gen's live ones
    ((command, sent),) = broker.sent
    assert (command, sent["arguments"], sent["timeout"]) == (
        "bf_load_lora", {"model": "gen", "name": "x", "path": "/a"}, 7.0)  # fmt: skip
    assert "pattern" not in sent
    # and w1's reply is printed (not enc's worker's), w2 is named, and the exit code is 3
    assert out.splitlines() == ['w1@h: {"ok": "load_lora x: gen serves x", "models": ["gen"], '
                                '"lora_adapters": {"gen": ["x"]}, "consumer": "w1"}']  # fmt: skip
    assert "w2 did not reply within 7 s" in err and "gone" not in err
    assert code == 3

    # When w2 replies too (by its hostname: a worker older than `consumer`)
    broker = scripted_broker(monkeypatch, {"w1@h": LOADED}, {"w2@h2": LOADED}, {"w9@h": LOADED})
    code, out, err = run(capsys, redis_url, "load-lora", "gen", "x", "/a")
    # Then the wait ended at its reply (none waited for after it), and all is well
    assert (code, err, broker.delivered) == (0, "", 2)
    assert [line.split(":")[0] for line in out.splitlines()] == ["w1@h", "w2@h2"]
    assert broker.sent[0][1]["timeout"] == 30.0  # the default

    # When one refuses: exit 1, whatever else happened
    refused = {"error": "gen: adapter 'x': rank 128 is over max_lora_rank 64", "code": "refused"}
    scripted_broker(monkeypatch, {"w1@h": LOADED}, {"w2@h2": refused})
    code, out, err = run(capsys, redis_url, "load-lora", "gen", "x", "/a")
    assert code == 1 and "max_lora_rank" in out
    scripted_broker(monkeypatch, {"w2@h2": refused})
    assert run(capsys, redis_url, "load-lora", "gen", "x", "/a")[0] == 1  # w1 missing too


def test_unloading_where_some_workers_had_not_loaded_it_is_done(
    redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    beats(r, "gen", "w1", "w2")
    gone = {"ok": "unload_lora x: gen serves no adapter", "models": ["gen"]}
    not_loaded = {"error": "gen: 'x' is not loaded", "code": "not_loaded", "consumer": "w2"}
    scripted_broker(monkeypatch, {"w1@h": gone}, {"w2@h": not_loaded})
    assert run(capsys, redis_url, "unload-lora", "gen", "x")[0] == 0
    # none had it: not found
    scripted_broker(monkeypatch, {"w1@h": not_loaded | {"consumer": "w1"}}, {"w2@h": not_loaded})
    assert run(capsys, redis_url, "unload-lora", "gen", "x")[0] == 1


def test_every_model_s_live_workers_are_waited_for_where_none_is_named(
    redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    beats(r, "gen", "w1")
    beats(r, "enc", "e1")
    paused = {"ok": "pause", "models": ["enc"], "consumer": "e1"}
    scripted_broker(monkeypatch, {"w1@h": {"ok": "pause", "models": ["gen"]}})
    code, out, err = run(capsys, redis_url, "pause", "--timeout", "2")
    assert (code, out.count("\n")) == (3, 1) and "e1 did not reply within 2 s" in err
    broker = scripted_broker(monkeypatch, {"w1@h": {"ok": "pause", "models": ["gen"]}},
                             {"e1@h": paused}, {"late@h": paused})  # fmt: skip
    assert run(capsys, redis_url, "pause")[0] == 0 and broker.delivered == 2


def test_destination_reaches_the_workers_it_names_without_a_ping(
    redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # Given two live workers of gen, on two hosts
    beats(r, "gen", "w1", "w2")
    replies = ({"w1@h1": {"ok": "drain", "models": ["gen"]}},
               {"w2@h2": {"ok": "drain", "models": ["gen"], "consumer": "w2"}})  # fmt: skip
    # When w2 (a bare name) is drained
    broker = scripted_broker(monkeypatch, *replies)
    code, out, err = run(capsys, redis_url, "drain", "gen", "-d", "w2")
    # Then the broadcast named it (no ping), only w2 got it, and only w2 was waited for
    assert (code, err) == (0, "") and out.startswith("w2@h2: ")
    ((_, sent),) = broker.sent
    assert sent["matcher"] == "pcre" and broker.delivered == 1
    # by its hostname too; a worker that is not live is not sent anything
    broker = scripted_broker(monkeypatch, *replies)
    code, out, err = run(capsys, redis_url, "resume", "gen", "-d", "w1@h1")
    assert (code, out.split(":")[0], broker.delivered) == (0, "w1@h1", 1)
    broker = scripted_broker(monkeypatch, *replies)
    code, out, err = run(capsys, redis_url, "resume", "gen", "-d", "w3")
    assert (code, out, broker.sent) == (1, "", []) and "no live worker named w3 of gen" in err
    r.delete(ModelKeys("gen").workers)
    code, out, err = run(capsys, redis_url, "policy", "gen", "max_batch_size=2")
    assert (code, broker.sent) == (1, []) and "no live worker of gen" in err


@pytest.mark.parametrize(
    ("names", "hostname", "reached"),
    [
        (["w1"], "w1@h", True),
        (["w1"], "w1@other.host", True),
        (["w1"], "w10@h", False),
        (["w1"], "xw1@h", False),
        (["w1@h"], "w1@h", True),
        (["w1@h"], "w1@h2", False),
        (["w1@h"], "w1@h.x", False),
        (["a.b"], "axb@h", False),
        (["w1", "w2@h"], "w2@h", True),
        (["w1", "w2@h"], "w3@h", False),
    ],
)
def test_a_destination_is_a_hostname_or_a_name_on_every_host(
    names: list[str], hostname: str, reached: bool
) -> None:
    # as each worker matches its own hostname (kombu's pcre matcher)
    assert bool(match(hostname, destination_pattern(names), "pcre")) is reached
    assert named(hostname, names) is reached  # a worker without --name: its hostname
    if reached:  # a worker with --name: its consumer name is that name
        assert named(hostname.split("@")[0], names)


def test_the_heartbeat_window_is_what_the_workers_published_unless_given(
    redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # Given gen's workers, which published a 20 s heartbeat timeout; w2 silent for 10 s
    beats(r, "gen", "w1")
    seconds, _ = r.time()
    r.hset(ModelKeys("gen").workers, "w2", seconds * 1000 - 10_000)
    r.set(ModelKeys("gen").heartbeat_timeout, 20_000)
    paused = {"ok": "pause", "models": ["gen"], "consumer": "w1"}
    # When gen is paused and only w1 replies
    scripted_broker(monkeypatch, {"w1@h": paused})
    code, _, err = run(capsys, redis_url, "pause", "gen", "--timeout", "2")
    # Then w2 was waited for (live within the fleet's 20 s) and is named
    assert code == 3 and "w2 did not reply within 2 s" in err
    # but not where the operator's window is shorter than its silence
    scripted_broker(monkeypatch, {"w1@h": paused})
    assert run(capsys, redis_url, "pause", "gen", "--heartbeat-window", "5")[:2] == (
        0, 'w1@h: {"ok": "pause", "models": ["gen"], "consumer": "w1"}\n')  # fmt: skip
    # and where no worker is live, the message says which window was applied
    broker = scripted_broker(monkeypatch)
    r.hset(ModelKeys("gen").workers, "w1", seconds * 1000 - 1000)
    monkeypatch.setenv("BATCHFLEET_HEARTBEAT_WINDOW", "0.001")
    code, _, err = run(capsys, redis_url, "pause", "gen")
    assert (code, broker.sent) == (1, []) and "within 0.001 s" in err


def test_a_reply_that_names_its_consumer_is_known_by_it_alone() -> None:
    # a worker named w1 in its fleet file, under plain `celery worker -n w2@h`
    assert replied_as("w2@h", {"consumer": "w1"}, ["w1", "w2"]) == "w1"
    assert replied_as("w2@h", {"consumer": "w1"}, ["w2"]) is None  # not w2's reply
    # a worker older than `consumer`: its hostname, or the name before its @
    assert replied_as("w2@h", {"ok": "pause"}, ["w2@h"]) == "w2@h"
    assert replied_as("w2@h", {"ok": "pause"}, ["w2"]) == "w2"
    assert replied_as("w2@h", {"ok": "pause"}, ["w1"]) is None


def test_destination_finds_a_worker_whose_hostname_is_not_its_name(
    redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # Given w4, named in its fleet file but started as `celery worker -n c4@h` (its
    # hostname published), and w1 (by --name: w1@h)
    beats(r, "gen", "w1", "w4")
    r.hset(ModelKeys("gen").hostnames, mapping={"w4": "c4@h", "w1": "w1@h"})
    replies = ({"w1@h": {"ok": "drain", "models": ["gen"], "consumer": "w1"}},
               {"c4@h": {"ok": "drain", "models": ["gen"], "consumer": "w4"}})  # fmt: skip
    for name in ("w4", "c4", "c4@h"):
        # When it is drained by its name, or its hostname
        broker = scripted_broker(monkeypatch, *replies)
        code, out, err = run(capsys, redis_url, "drain", "gen", "-d", name)
        # Then it alone got it, and was waited for
        assert (code, err, broker.delivered) == (0, "", 1), name
        assert out.startswith("c4@h: ")
    assert addressed(["w1", "w4"], {"w4": "c4@h"}, ["w4"]) == (["w4"], ["w4", "c4@h"])


def test_init_groups_publishes_the_fleet_s_heartbeat_timeout(
    redis_url: str, r: redis.Redis
) -> None:
    from batchfleet.config import FleetConfig, ModelConfig, WorkerConfig
    from batchfleet.control_wait import live_workers
    from batchfleet.groups import init_groups

    # Given a fleet file whose workers are taken for dead after 15 s of silence, deployed
    fleet = FleetConfig(redis_url=redis_url, models={"gen": ModelConfig()},
                        worker=WorkerConfig(heartbeat_timeout_ms=15_000))  # fmt: skip
    init_groups(fleet)
    # Then a worker silent for 10 s is still waited for, before any worker started
    seconds, _ = r.time()
    r.hset(ModelKeys("gen").workers, "w1", seconds * 1000 - 10_000)
    assert live_workers(r, ["gen"]) == (["w1"], 15_000)
