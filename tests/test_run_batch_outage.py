"""``batchfleet run-batch`` while Redis fails, refusing (stopped, crashed) or silent (a hung
network: :class:`~silent_network.SilentProxy`), for generation and pooling lines alike:
a line sent or waiting rides out an outage for ``retry_for_s``, then is a 503 line (never
after redis-py's minute of socket timeouts); answered where Redis is back sooner; Ctrl-C
during an outage exits 130 at once with the lines written whole; unreachable from the
start, exit 1. The test plays the worker; every wait is for an event, with a hang guard."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from batch_process import RunBatch, take
from gateway_fakes import ScriptedWorker, Taken
from silent_network import SilentProxy

from batchfleet import cli
from batchfleet.connection import SyncClient
from batchfleet.redis_server import LocalRedis, free_port
from batchfleet.run_batch import Settings, run_batch

pytestmark = pytest.mark.timeout(180)

GUARD_S = 60.0
"""How long a wait may last before the test calls it a hang (each ends far sooner)."""
HUNG_GUARD_S = 30.0
"""The hang guard where a silent network is met: redis-py alone would wait a minute
(socket timeouts of 15 s, tried 4 times) before the producer's retries even begin."""


def line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat(custom_id: str) -> str:
    """A chat line whose fleet request id is its custom_id."""
    return line(custom_id, "/v1/chat/completions", {"model": "mm", "request_id": custom_id,
                "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip


def embed(custom_id: str) -> str:
    return line(custom_id, "/v1/embeddings", {"model": "mm", "input": ["a dog", "a cat"]})


def score(custom_id: str) -> str:
    """One text against two: one ranking request to the fleet."""
    return line(custom_id, "/v1/score", {"model": "mm", "text_1": "a pet",
                                         "text_2": ["a dog", "a car"]})  # fmt: skip


def rerank(custom_id: str) -> str:
    return line(custom_id, "/v1/rerank", {"model": "mm", "query": "a pet",
                                          "documents": ["a dog", "a car"]})  # fmt: skip


GEN = {"text": "Hi!", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2}
RANKED = [[{"index": 0, "score": 0.75}, {"index": 1, "score": -0.5}]]
"""The rerank runner's ranking (best first) of score's and rerank's two documents."""
KINDS: dict[str, tuple[Callable[[str], str], list[Any]]] = {
    "chat": (chat, [GEN]),
    "embeddings": (embed, [[0.5, -0.25], [1.0, 0.0]]),
    "score": (score, RANKED),
    "rerank": (rerank, RANKED),
}
"""A line of each kind, and the outputs its worker answers with."""


def answered_as_usual(kind: str, out: dict[str, Any]) -> None:
    assert out["error"] is None, out
    assert out["response"]["status_code"] == 200
    body = out["response"]["body"]
    if kind == "chat":
        assert body["choices"][0]["message"]["content"] == "Hi!"
    elif kind == "embeddings":
        assert [d["embedding"] for d in body["data"]] == KINDS[kind][1]
    elif kind == "score":
        assert [(d["index"], d["score"]) for d in body["data"]] == [(0, 0.75), (1, -0.5)]
    else:
        assert [(r["index"], r["relevance_score"], r["document"]["text"])
                for r in body["results"]] == [(0, 0.75, "a dog"), (1, -0.5, "a car")]  # fmt: skip


def unavailable(out: dict[str, Any], redis_url: str) -> str:
    """The message of a 503 ``unavailable`` line that names ``redis_url``."""
    assert out["response"]["status_code"] == 503 and out["response"]["body"] is None, out
    error = out["error"]["error"]
    assert error["code"] == "unavailable"
    assert error["message"].startswith(f"cannot reach Redis at {redis_url}: "), error
    return str(error["message"])


@pytest.fixture
def own_redis() -> Iterator[LocalRedis]:
    """A Redis of this test's own, to stop and start (its data kept on disk)."""
    server = LocalRedis(appendonly=True, appendfsync="always")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def proxy(redis_url: str) -> Iterator[SilentProxy]:
    """The session's Redis behind a network that can go silent."""
    hung = SilentProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    yield hung
    hung.close()


# --- a line sent while Redis is gone ----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_line_sent_while_redis_is_down_is_a_503_line_and_the_run_goes_on(kind: str) -> None:
    # Given a run whose Redis stops once it has started (connected, subscribed)
    make, _ = KINDS[kind]
    server = LocalRedis()
    url = server.start()

    async def lines() -> AsyncIterator[str]:
        server.stop()  # When Redis goes away before the lines are sent
        yield make("a") + "\n"
        yield make("b") + "\n"

    out: list[str] = []
    try:
        with redis.Redis.from_url(url) as client:
            ScriptedWorker(client, "mm")  # (the model's lanes)
        settings = Settings(progress_s=0, retry_for_s=1.0)
        summary = asyncio.run(run_batch(url, lines(), out.append, settings))
    finally:
        server.stop()
    # Then each line, its model read retried for retry_for_s, is answered as the gateway
    # answers then: 503, unavailable, naming the outage
    assert (summary.lines, summary.failed) == (2, 2)
    answers = [json.loads(line) for line in out]
    assert [a["custom_id"] for a in answers] == ["a", "b"]
    for answer in answers:
        assert answer["response"]["status_code"] == 503 and answer["response"]["body"] is None
        assert answer["error"]["error"]["code"] == "unavailable"
        assert answer["error"]["error"]["message"].startswith("cannot reach Redis at ")
        assert "(unreachable " in answer["error"]["error"]["message"]


def test_a_line_sent_while_the_network_is_silent_is_a_503_line_after_retry_for(
    redis_url: str, proxy: SilentProxy
) -> None:
    # Given a run through a network that goes silent once the run has started
    client = redis.Redis.from_url(redis_url)
    ScriptedWorker(client, "mm")
    client.close()

    async def lines() -> AsyncIterator[str]:
        proxy.silence()  # When the lines are sent into it (neither refused nor answered)
        for custom_id, (make, _) in zip("abcd", KINDS.values(), strict=True):
            yield make(custom_id) + "\n"

    out: list[str] = []
    settings = Settings(progress_s=0, retry_for_s=0.5)
    asyncio.run(asyncio.wait_for(run_batch(proxy.url(), lines(), out.append, settings),
                                 HUNG_GUARD_S))  # fmt: skip
    # Then each is a 503 line once retry_for_s has passed (not redis-py's minute a try)
    answers = [json.loads(line) for line in out]
    assert [a["custom_id"] for a in answers] == ["a", "b", "c", "d"]
    for answer in answers:
        assert "no answer to PING in 0.5 s" in unavailable(answer, proxy.url())


def test_redis_unreachable_from_the_start_exits_1_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(chat("a") + "\n")
    nobody = f"redis://127.0.0.1:{free_port()}/0"
    code = cli.main(["run-batch", "--redis-url", nobody, "-i", str(source), "-o",
                     str(tmp_path / "out.jsonl"), "--progress-interval", "0"])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "batchfleet run-batch: ConnectionError: " in err and nobody[8:-2] in err
    assert (tmp_path / "out.jsonl").read_text() == ""  # (created, nothing written)


def test_a_network_silent_from_the_start_exits_1_naming_it(
    proxy: SilentProxy, tmp_path: Path
) -> None:
    # Given a Redis behind a network that accepts connections and never answers
    proxy.silence()
    # When a run starts, Then it stops as where Redis refuses (not after redis-py's minute
    # of tries): exit 1
    stops_at_its_start_naming(proxy.url(), tmp_path)


def stops_at_its_start_naming(url: str, tmp_path: Path) -> None:
    """A run of one line on ``url``, whose Redis never answers, exits 1 at its start,
    naming the Redis that did not answer, and writes nothing."""
    (tmp_path / "in.jsonl").write_text(chat("a") + "\n")
    run = RunBatch(url, tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    try:
        code, stderr = run.end(HUNG_GUARD_S)
    finally:
        run.kill()
    assert code == 1, stderr
    assert f"TimeoutError: Redis at {url} did not answer within 15 s" in stderr
    assert (tmp_path / "out.jsonl").read_text() == ""


# --- a line waiting for its result when Redis goes --------------------------------------------


def waited(fake: ScriptedWorker, redis_url: str) -> Taken:
    """The next request taken, once the run waits for its result: it reads its result key
    (at once, or again at its next sweep, 2 s on), as MONITOR shows."""
    taken = fake.take()
    with redis.Redis.from_url(redis_url).monitor() as monitor:
        for command in monitor.listen():
            if command["command"].startswith("GET ") and taken.id in command["command"]:
                return taken
    raise AssertionError("MONITOR ended")


def run_one_line(
    text: str, run_url: str, redis_url: str, outage: Callable[[Taken, ScriptedWorker], object],
    retry_for_s: float, client: SyncClient | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The line ``text`` run through the fleet at ``run_url`` (default ``--timeout``: an
    hour), ``redis_url`` that Redis seen directly (the node of mm's keys, on a cluster,
    ``client`` the whole cluster's); once it waits for its result (its last part: an
    embeddings line of two inputs may be two requests), ``outage(taken, worker)`` plays
    the rest in a thread. Its output line."""
    client = client or redis.Redis.from_url(redis_url)
    fake = ScriptedWorker(client, "mm")
    worker = threading.Thread(target=lambda: outage(waited(fake, redis_url), fake))
    worker.start()

    async def lines() -> AsyncIterator[str]:
        yield text + "\n"

    out: list[str] = []
    settings = Settings(progress_s=0, retry_for_s=retry_for_s)
    try:
        asyncio.run(asyncio.wait_for(run_batch(run_url, lines(), out.append, settings),
                                     GUARD_S))  # fmt: skip
    finally:
        worker.join(GUARD_S)
        client.close()
    (answer,) = [json.loads(line) for line in out]
    return dict(answer)


@pytest.mark.parametrize("kind", KINDS)
def test_a_line_waiting_when_redis_goes_away_for_good_is_a_503_line_after_retry_for(
    kind: str, own_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a line waiting for its result; When Redis then goes away and stays away
    url = own_redis.url
    out = run_one_line(KINDS[kind][0]("a"), url, url, lambda taken, fake: own_redis.crash(),
                       retry_for_s=0.5)  # fmt: skip
    # Then after retry_for_s (not --timeout's hour) the line is a 503 unavailable line
    unavailable(out, url)
    # and its cancel is not tried (it would ride out the retries in vain): logged
    assert f"Redis unreachable: requests {out['response']['request_id']}" in caplog.text
    assert "not cancelled" in caplog.text


@pytest.mark.parametrize("kind", KINDS)
def test_a_line_waiting_when_redis_restarts_within_retry_for_is_answered(
    kind: str, own_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    make, outputs = KINDS[kind]

    def outage(taken: Taken, fake: ScriptedWorker) -> None:
        # When Redis goes away, the run sees it, and it comes back on the same port
        own_redis.crash()
        end = time.monotonic() + GUARD_S
        while "run-batch: Redis unreachable" not in caplog.text and time.monotonic() < end:
            time.sleep(0.05)
        own_redis.start()
        fake.ok(taken, outputs)  # (the worker answers after the restart)

    # Given a line waiting for its result, on a Redis that keeps its data on disk
    url = own_redis.url
    out = run_one_line(make("a"), url, url, outage, retry_for_s=GUARD_S)
    # Then the line is answered as if nothing happened
    answered_as_usual(kind, out)


def test_a_line_waiting_when_the_network_goes_silent_is_a_503_line_after_retry_for(
    redis_url: str, proxy: SilentProxy, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a line waiting for its result; When the network then goes silent for good
    out = run_one_line(chat("a"), proxy.url(), redis_url, lambda taken, fake: proxy.silence(),
                       retry_for_s=0.5)  # fmt: skip
    # Then after retry_for_s the line is a 503 line (its PINGs unanswered), not cancelled
    assert "no answer to PING in 0.5 s" in unavailable(out, proxy.url())
    assert "Redis unreachable: requests a not cancelled" in caplog.text


def test_a_line_waiting_when_the_network_is_silent_a_while_is_answered(
    redis_url: str, proxy: SilentProxy, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr("batchfleet.run_batch_outage.PING_TIMEOUT_S", 0.5)

    def outage(taken: Taken, fake: ScriptedWorker) -> None:
        # When the network goes silent, the run sees it, and the worker answers meanwhile
        proxy.silence()
        end = time.monotonic() + GUARD_S
        while "run-batch: Redis unreachable" not in caplog.text and time.monotonic() < end:
            time.sleep(0.05)
        fake.ok(taken, KINDS["embeddings"][1])
        proxy.heal()

    out = run_one_line(embed("a"), proxy.url(), redis_url, outage, retry_for_s=GUARD_S)
    # Then once it answers again the line is answered as usual
    answered_as_usual("embeddings", out)


# --- Ctrl-C during an outage ------------------------------------------------------------------


@pytest.mark.parametrize("outage", ["refused", "silent"])
def test_ctrl_c_during_an_outage_exits_130_at_once_keeping_the_lines_written_whole(
    outage: str, own_redis: LocalRedis, tmp_path: Path
) -> None:
    # Given a run of three lines, all sent, the first answered and written
    client = redis.Redis.from_url(own_redis.url)
    fake = ScriptedWorker(client, "mm")
    hung = SilentProxy(own_redis.port)
    url = hung.url() if outage == "silent" else own_redis.url
    (tmp_path / "in.jsonl").write_text("\n".join(map(chat, ["line-a", "line-b", "line-c"])))
    run = RunBatch(url, tmp_path / "in.jsonl", tmp_path / "out.jsonl", "--progress-interval",
                   "0.05")  # fmt: skip
    try:
        taken = {t.id: t for t in (take(fake), take(fake), take(fake))}
        fake.ok(taken["line-a"], [GEN])
        run.wait_for(r"run-batch: 3 lines read, 1 written \(0 failed\), 2 in flight")
        # When Redis goes (seen by the run, where it refuses; at once, where it is silent)
        if outage == "refused":
            own_redis.crash()
            run.wait_for("run-batch: Redis unreachable")
        else:
            hung.silence()
        # and the run is stopped with Ctrl-C
        run.proc.send_signal(signal.SIGINT)
        code, stderr = run.end(HUNG_GUARD_S)
    finally:
        run.kill()
        hung.close()
        client.close()
    # Then it exits 130 at once (neither retry_for_s nor redis-py's timeouts waited out)
    assert code == 130, stderr
    assert "Traceback" not in stderr
    assert re.search(r"run-batch: end: 3 lines read, 1 written \(0 failed\), 0 in flight",
                     stderr)  # fmt: skip
    # and the lines in flight are left uncancelled, saying so (Redis known down: not
    # tried; silent: tried for a few seconds)
    why = ("Redis unreachable: requests line-[bc] not cancelled" if outage == "refused" else
           r"requests line-[bc] not cancelled: no answer within 3 s of the stop")  # fmt: skip
    assert len(re.findall(why, stderr)) == 2, stderr
    # and the output holds the line answered, whole, and nothing else
    text = (tmp_path / "out.jsonl").read_text()
    assert text.endswith("\n")
    (answer,) = [json.loads(line) for line in text.splitlines()]
    assert (answer["custom_id"], answer["response"]["status_code"]) == ("line-a", 200)
