"""``batchfleet run-batch`` on a Redis Cluster (``redis+cluster://``) whose masters go silent
(each behind a :class:`~silent_network.SilentProxy`, announced in the slot map as its
address): the bounds of a single Redis hold (test_run_batch_outage.py). One master silent
is an outage of the batch, whichever slots it holds (its model's keys, the set of models,
the reply channel): the cluster client sends a plain PING to one node, and a command to a
silent master waits out redis-py's socket timeouts and the cluster client's retries, a
minute. The test plays the worker, reaching the masters directly."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from batch_process import RunBatch, take
from gateway_fakes import ScriptedWorker, Taken
from hidden_cluster import HiddenCluster
from test_run_batch_outage import (
    GEN,
    GUARD_S,
    HUNG_GUARD_S,
    KINDS,
    answered_as_usual,
    chat,
    run_one_line,
    stops_at_its_start_naming,
    unavailable,
)

from batchfleet.run_batch import Settings, run_batch

pytestmark = pytest.mark.timeout(180)

MODEL_KEYS = "{mm}"
"""The hash tag of every key of the model the lines go to (its master holds them all)."""


# --- a line sent while a master is silent -----------------------------------------------------


@pytest.mark.parametrize("silent", ["its model's master", "another master"])
def test_a_line_sent_while_a_master_is_silent_is_a_503_line_after_retry_for(
    silent: str, hidden: HiddenCluster
) -> None:
    # Given a run on the cluster whose model's lanes are there
    with hidden.direct() as client:
        ScriptedWorker(client, "mm")
    which = hidden.master_of(MODEL_KEYS) if silent == "its model's master" else (
        hidden.another(MODEL_KEYS))  # fmt: skip

    async def lines() -> AsyncIterator[str]:
        hidden.proxies[which].silence()  # When a master goes silent as the lines are sent
        for custom_id, (make, _) in zip("abcd", KINDS.values(), strict=True):
            yield make(custom_id) + "\n"

    out: list[str] = []
    settings = Settings(progress_s=0, retry_for_s=0.5)
    asyncio.run(asyncio.wait_for(run_batch(hidden.url, lines(), out.append, settings),
                                 HUNG_GUARD_S))  # fmt: skip
    # Then every line (generation and pooling alike) is a 503 line once retry_for_s has
    # passed, within the hang guard: not the cluster client's minute of tries
    answers = [json.loads(line) for line in out]
    assert [a["custom_id"] for a in answers] == ["a", "b", "c", "d"]
    for answer in answers:
        assert "no answer to PING in 0.5 s" in unavailable(answer, hidden.url)


# --- a line waiting for its result when a master goes silent ----------------------------------


def node_url(hidden: HiddenCluster, index: int) -> str:
    return f"redis://127.0.0.1:{hidden.cluster.ports[index]}/0"


def test_a_line_waiting_when_its_master_goes_silent_is_a_503_line_after_retry_for(
    hidden: HiddenCluster, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a score line waiting for its result; When its model's master goes silent
    mine = hidden.master_of(MODEL_KEYS)
    with hidden.direct() as client:
        out = run_one_line(KINDS["score"][0]("a"), hidden.url, node_url(hidden, mine),
                           lambda taken, fake: hidden.proxies[mine].silence(), retry_for_s=0.5,
                           client=client)  # fmt: skip
    # Then after retry_for_s it is a 503 line, its cancel not tried (Redis known down)
    assert "no answer to PING in 0.5 s" in unavailable(out, hidden.url)
    assert f"Redis unreachable: requests {out['response']['request_id']} not cancelled" in (
        caplog.text)  # fmt: skip


@pytest.mark.parametrize("kind", ["chat", "rerank"])
def test_a_line_waiting_when_a_master_is_silent_a_while_is_answered(
    kind: str, hidden: HiddenCluster, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr("batchfleet.run_batch_outage.PING_TIMEOUT_S", 0.5)
    make, outputs = KINDS[kind]
    mine = hidden.master_of(MODEL_KEYS)

    def outage(taken: Taken, fake: ScriptedWorker) -> None:
        # When its model's master goes silent, the run sees it, the worker answers meanwhile
        hidden.proxies[mine].silence()
        end = time.monotonic() + GUARD_S
        while "run-batch: Redis unreachable" not in caplog.text and time.monotonic() < end:
            time.sleep(0.05)
        fake.ok(taken, outputs)
        hidden.proxies[mine].heal()

    # Given a line waiting for its result (retry_for_s longer than the outage)
    with hidden.direct() as client:
        out = run_one_line(make("a"), hidden.url, node_url(hidden, mine), outage,
                           retry_for_s=GUARD_S, client=client)  # fmt: skip
    # Then once the master answers again the line is answered as usual
    answered_as_usual(kind, out)


# --- the run's start and its stop -------------------------------------------------------------


def test_a_cluster_with_a_master_silent_from_the_start_exits_1_naming_it(
    hidden: HiddenCluster, tmp_path: Path
) -> None:
    # Given a cluster one of whose masters (not the URL's) accepts and never answers
    with hidden.direct() as client:
        ScriptedWorker(client, "mm")
    hidden.proxies[hidden.another(MODEL_KEYS)].silence()
    # When a run starts, Then it stops, naming it, as where a single Redis is silent from
    # the start: exit 1
    stops_at_its_start_naming(hidden.url, tmp_path)


def test_ctrl_c_while_a_master_is_silent_exits_130_at_once(
    hidden: HiddenCluster, tmp_path: Path
) -> None:
    # Given a run of three lines, all sent, the first answered and written
    client = hidden.direct()
    fake = ScriptedWorker(client, "mm")
    (tmp_path / "in.jsonl").write_text("\n".join(map(chat, ["line-a", "line-b", "line-c"])))
    run = RunBatch(hidden.url, tmp_path / "in.jsonl", tmp_path / "out.jsonl",
                   "--progress-interval", "0.05")  # fmt: skip
    try:
        taken = {t.id: t for t in (take(fake), take(fake), take(fake))}
        fake.ok(taken["line-a"], [GEN])
        run.wait_for(r"run-batch: 3 lines read, 1 written \(0 failed\), 2 in flight")
        # When the master of the lines' model goes silent and the run is stopped (Ctrl-C)
        hidden.proxies[hidden.master_of(MODEL_KEYS)].silence()
        run.proc.send_signal(signal.SIGINT)
        code, stderr = run.end(HUNG_GUARD_S)
    finally:
        run.kill()
        client.close()
    # Then it exits 130 within the hang guard (its cancels given up after 3 s), saying so
    assert code == 130, stderr
    assert "Traceback" not in stderr
    assert re.search(r"run-batch: end: 3 lines read, 1 written \(0 failed\), 0 in flight",
                     stderr)  # fmt: skip
    assert len(re.findall(r"requests line-[bc] not cancelled", stderr)) == 2, stderr
    (answer,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert (answer["custom_id"], answer["response"]["status_code"]) == ("line-a", 200)
