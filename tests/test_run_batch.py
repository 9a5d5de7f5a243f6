"""``batchfleet run-batch`` (vLLM's ``run-batch``, OpenAI's batch file format): the line
rules as functions; the batch in-process against a real Redis with the test playing the
worker (order, failures, a full queue, model names); then the command line against a
real worker serving a tiny random Llama and an embedding model, with local files, stdin
and stdout, and http(s) URLs."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import io
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from batchfleet.schemas.messages import ErrorInfo, Limits, Result, Usage
from conftest import TINY_LM_OPTIONS, WorkerProcess, fleet_toml
from gateway_fakes import ScriptedWorker

from batchfleet import cli
from batchfleet.run_batch import OrderedWriter, Settings, output_line, parse_line, run_batch
from batchfleet.run_batch_metrics import RunBatchMetrics

pytestmark = pytest.mark.timeout(240)

QUIET = Settings(progress_s=0)


def chat(custom_id: str, model: str = "mm", **extra: Any) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return json.dumps({"custom_id": custom_id, "method": "POST",
                       "url": "/v1/chat/completions", "body": body})  # fmt: skip


def gen(text: str = "Hi!") -> dict[str, Any]:
    return {"text": text, "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2}


async def feed(*texts: str) -> AsyncIterator[str]:
    for text in texts:
        yield text + "\n"


# --- the rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "custom_id", "param", "said"), [
    ("{not json", None, None, "line 7 is not JSON"),
    ("[1, 2]", None, None, "line 7 is not a JSON object"),
    ('{"method": "POST", "url": "/v1/completions", "body": {}}', None, "custom_id",
     "custom_id must be a string"),
    ('{"custom_id": 5, "method": "POST", "url": "/v1/completions", "body": {}}', None,
     "custom_id", "custom_id must be a string"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {}}', "a", "method",
     "method must be a string"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "a",
     "method", "only POST"),
    ('{"custom_id": "a", "method": "POST", "body": {}}', "a", "url", "url must be a string"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"}', "a",
     "body", "body must be an object"),
])  # fmt: skip
def test_a_line_that_cannot_be_sent_is_refused_naming_it(
    text: str, custom_id: str | None, param: str | None, said: str
) -> None:
    line = parse_line(text, 7)
    assert line.custom_id == custom_id and line.error is not None
    assert said in line.error.message and line.error.param == param
    assert (line.error.status, line.error.code) == (400, "invalid_request")


def test_a_good_line_is_read_whole() -> None:
    line = parse_line(chat("c-1", temperature=0), 1)
    assert (line.custom_id, line.url, line.error) == ("c-1", "/v1/chat/completions", None)
    assert line.body["temperature"] == 0


def test_output_lines_are_written_in_input_order_as_they_come() -> None:
    written: list[str] = []
    writer = OrderedWriter(written.append)
    from batchfleet.producer.gateway.direct import Outcome

    def line(n: int, ok: bool = True) -> dict[str, Any]:
        outcome = Outcome(f"r{n}", 200, {"n": n}) if ok else Outcome(f"r{n}", 500, error={})
        return output_line(f"c{n}", outcome)

    writer.add(2, line(2))
    writer.add(1, line(1, ok=False))
    assert written == []  # line 0 not answered yet
    writer.add(0, line(0))
    assert [json.loads(w)["custom_id"] for w in written] == ["c0", "c1", "c2"]
    writer.add(3, line(3))
    assert len(written) == 4 and writer.failed == 1
    first = json.loads(written[0])
    assert set(first) == {"id", "custom_id", "response", "error"}
    assert first["response"] == {"status_code": 200, "request_id": "r0", "body": {"n": 0}}
    assert first["id"].startswith("batch_req_") and first["error"] is None


# --- in-process, the test playing the worker -------------------------------------------------


@contextlib.contextmanager
def scripted(redis_url: str, model: str = "mm", **options: Any) -> Iterator[ScriptedWorker]:
    client = redis.Redis.from_url(redis_url)
    try:
        yield ScriptedWorker(client, model, **options)
    finally:
        client.close()


@pytest.fixture
def fake(redis_url: str) -> Iterator[ScriptedWorker]:
    with scripted(redis_url) as worker:
        yield worker


def test_a_failed_result_is_an_error_line_and_order_is_kept(
    redis_url: str, fake: ScriptedWorker
) -> None:
    async def go() -> list[dict[str, Any]]:
        out: list[str] = []
        lines = [chat(c, messages=[{"role": "user", "content": c}]) for c in "ab"]
        batch = asyncio.ensure_future(run_batch(redis_url, feed(*lines), out.append, QUIET))
        taken = [await asyncio.to_thread(fake.take) for _ in lines]
        # the lines' requests reach Redis in either order (each its own connection)
        first, second = sorted(
            taken, key=lambda t: str(t.request.messages and t.request.messages[0].content)
        )
        # the second answered first: nothing is written until the first is
        await asyncio.to_thread(fake.ok, second, [gen("second")], Usage(prompt_tokens=3,
                                completion_tokens=2))  # fmt: skip
        failed = Result(id=first.id, model="mm", status="error",
                        error=ErrorInfo(code="inference_failed", message="CUDA OOM"))  # fmt: skip
        await asyncio.to_thread(fake.answer, first, failed)
        summary = await batch
        assert (summary.lines, summary.failed) == (2, 1)
        return [json.loads(line) for line in out]

    lines = asyncio.run(go())
    assert [line["custom_id"] for line in lines] == ["a", "b"]
    bad, good = lines
    assert bad["response"]["status_code"] == 500 and bad["response"]["body"] is None
    assert bad["error"]["error"]["code"] == "inference_failed"
    assert "CUDA OOM" in bad["error"]["error"]["message"]
    body = good["response"]["body"]
    assert good["error"] is None and good["response"]["status_code"] == 200
    assert body["object"] == "chat.completion" and body["model"] == "mm"
    assert body["choices"][0]["message"]["content"] == "second"
    # the response's request_id is the fleet's: the answer's id is made of it
    assert body["id"] == f"chatcmpl-{good['response']['request_id']}"


def test_a_line_written_is_no_longer_in_flight_in_the_metrics(
    redis_url: str, fake: ScriptedWorker
) -> None:
    """A scrape (another thread) that sees a line answered sees it out of flight: the
    gauge drops before the line is counted and written."""
    metrics = RunBatchMetrics()

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(f"batchfleet_run_batch_{name}")

    at_write: list[tuple[float | None, ...]] = []

    def write(text: str) -> None:
        at_write.append((sample("lines_in_flight"), sample("line_duration_seconds_count")))

    async def go() -> None:
        batch = asyncio.ensure_future(run_batch(redis_url, feed(chat("a")), write, QUIET,
                                                metrics=metrics))  # fmt: skip
        await asyncio.to_thread(fake.ok, await asyncio.to_thread(fake.take), [gen()])
        await batch

    asyncio.run(go())
    assert at_write == [(0.0, 1.0)]
    labels = {"status": "200", "code": ""}
    assert metrics.registry.get_sample_value(
        "batchfleet_run_batch_lines_answered_total", labels) == 1  # fmt: skip


def test_model_names_are_mapped_and_answered_as_the_file_names_them(
    redis_url: str, fake: ScriptedWorker
) -> None:
    settings = Settings(progress_s=0, models={"meta-llama/Llama-3": "mm"}, default_model="mm")
    bare = json.dumps({"custom_id": "bare", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "x", "request_id": "my-id-1"}})  # fmt: skip

    async def go() -> list[dict[str, Any]]:
        out: list[str] = []
        batch = asyncio.ensure_future(run_batch(
            redis_url, feed(chat("mapped", "meta-llama/Llama-3"), bare), out.append, settings))  # fmt: skip
        for _ in range(2):
            taken = await asyncio.to_thread(fake.take)
            await asyncio.to_thread(fake.ok, taken, [gen()])
        await batch
        return [json.loads(line) for line in out]

    mapped, plain = asyncio.run(go())
    assert mapped["response"]["body"]["model"] == "meta-llama/Llama-3"
    # a line with no model goes to --model; its body's request_id is the fleet's id
    assert plain["response"]["body"]["model"] == "mm"
    assert plain["response"]["request_id"] == "my-id-1"
    assert plain["response"]["body"]["object"] == "text_completion"


def test_a_line_that_breaks_the_program_is_an_error_line_and_the_others_go_on(
    redis_url: str, fake: ScriptedWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchfleet import run_batch as module

    async def answer(gateway: Any, url: str, body: Any, models: Any, **options: Any) -> Any:
        if body["messages"][0]["content"] == "boom":
            raise RuntimeError("a bug")
        return await real(gateway, url, body, models, **options)

    real = module.answer
    monkeypatch.setattr(module, "answer", answer)
    boom = json.dumps({"custom_id": "boom", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "mm", "messages": [{"role": "user", "content": "boom"}]}})  # fmt: skip

    async def go() -> list[dict[str, Any]]:
        out: list[str] = []
        batch = asyncio.ensure_future(run_batch(redis_url, feed(boom, chat("ok")), out.append,
                                                QUIET))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.ok, taken, [gen()])
        await batch
        return [json.loads(line) for line in out]

    broken, fine = asyncio.run(go())
    assert broken["response"]["status_code"] == 500
    assert broken["error"]["error"]["code"] == "internal"
    assert "RuntimeError: a bug" in broken["error"]["error"]["message"]
    assert fine["response"]["status_code"] == 200


def test_a_line_past_its_timeout_is_answered_504_and_cancelled_in_the_fleet(
    redis_url: str, fake: ScriptedWorker
) -> None:
    async def go() -> list[dict[str, Any]]:
        out: list[str] = []
        settings = Settings(progress_s=0, timeout_s=0.05)  # never answered: it times out
        await run_batch(redis_url, feed(chat("late")), out.append, settings)
        return [json.loads(line) for line in out]

    (line,) = asyncio.run(go())
    assert line["response"]["status_code"] == 504 and line["error"]["error"]["code"] == "timeout"
    taken = fake.take()
    assert taken.id == line["response"]["request_id"] and fake.cancelled(taken)


def test_a_stopped_run_cancels_its_lines_in_the_fleet(redis_url: str, fake: ScriptedWorker) -> None:
    async def go() -> list[str]:
        out: list[str] = []
        batch = asyncio.ensure_future(run_batch(redis_url, feed(chat("a")), out.append, QUIET))
        taken = await asyncio.to_thread(fake.take)
        batch.cancel()  # as Ctrl-C does
        with contextlib.suppress(asyncio.CancelledError):
            await batch
        assert await asyncio.to_thread(fake.cancelled, taken)
        return out

    assert asyncio.run(go()) == []


def test_a_run_stopped_at_any_point_ends_stopped(redis_url: str, fake: ScriptedWorker) -> None:
    """Stopped at 0, 3, 6 ... event-loop turns from its start (connecting, subscribing,
    sending the line, waiting for it), a run ends cancelled; one that lost the stop would
    go on to answer its line (a 504 at its timeout)."""

    async def go() -> dict[str, int]:
        ends = {"cancelled": 0, "went on": 0}
        settings = Settings(progress_s=0, timeout_s=5)
        for n in range(0, 240, 3):
            batch = asyncio.ensure_future(run_batch(redis_url, feed(chat("a")), [].append,
                                                    settings))  # fmt: skip
            for _ in range(n):
                await asyncio.sleep(0)
            batch.cancel()  # as Ctrl-C does
            await asyncio.wait({batch}, timeout=60)  # (a hang guard, far past its 5 s)
            if not batch.done():
                raise AssertionError(f"stopped after {n} turns, it hangs")
            try:
                await batch
                ends["went on"] += 1
            except asyncio.CancelledError:
                ends["cancelled"] += 1
        return ends

    assert asyncio.run(go()) == {"cancelled": 80, "went on": 0}
    sent = sum(fake.streams.client.xlen(lane) for lane in fake.streams.streams)
    assert 0 < sent < 80, sent  # (the stops landed before sending and while waiting)


def test_a_full_queue_is_waited_out_not_failed(redis_url: str) -> None:
    # Given a model whose lanes take one request, and one request already waiting
    with scripted(redis_url, max_depth=1, limits=Limits()) as fake:
        from batchfleet.producer import Producer

        with Producer(redis_url) as producer:
            producer.submit("mm", "hold", max_new_tokens=1)
        waits: list[float] = []
        freed = asyncio.Event()

        async def sleep(seconds: float) -> None:
            """The batch waits: at its second wait, the worker answers the waiting request
            (an answered request leaves the lane)."""
            waits.append(seconds)
            if len(waits) == 2:
                held = await asyncio.to_thread(fake.take)
                await asyncio.to_thread(fake.ok, held, [gen()])
                freed.set()

        metrics = RunBatchMetrics()

        async def go() -> list[dict[str, Any]]:
            out: list[str] = []
            # When the line is refused as queue_full, then room is made
            batch = asyncio.ensure_future(run_batch(redis_url, feed(chat("a")), out.append,
                                                    QUIET, sleep=sleep, metrics=metrics))  # fmt: skip
            room = asyncio.ensure_future(freed.wait())
            await asyncio.wait({room, batch}, return_when=asyncio.FIRST_COMPLETED)
            if not batch.done():  # (else it gave up: the line says how)
                taken = await asyncio.to_thread(fake.take)
                await asyncio.to_thread(fake.ok, taken, [gen()])
            await batch
            room.cancel()
            return [json.loads(line) for line in out]

        (line,) = asyncio.run(go())
        # Then it was sent again, backing off, and answered
        assert waits == [0.1, 0.2]
        assert line["response"]["status_code"] == 200, line
        # and --enable-metrics counts each time it was sent again
        assert metrics.registry.get_sample_value(
            "batchfleet_run_batch_queue_full_retries_total") == len(waits)  # fmt: skip


# --- the command line against a real worker --------------------------------------------------


@pytest.fixture(scope="module")
def fleet_url(
    redis_server: Any, tmp_path_factory: pytest.TempPathFactory, tiny_lm: Path,
    tiny_embedder: Path,
) -> Iterator[str]:  # fmt: skip
    """One worker serving the tiny Llama as ``lm`` and the embedding model as ``embed``."""
    tmp = tmp_path_factory.mktemp("run-batch")
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    models = {"lm": {"runner": "text-generation", "path": str(tiny_lm), "options": TINY_LM_OPTIONS},
              "embed": {"runner": "embedding", "path": str(tiny_embedder), "max_tokens": 64}}  # fmt: skip
    config = tmp / "fleet.toml"
    config.write_text(fleet_toml(redis_server.url, models))
    worker = WorkerProcess(config, "rb-worker", tmp / "worker.log")
    try:
        for model in models:
            worker.wait_ready(client, model)
        yield redis_server.url
    finally:
        worker.stop()
        client.close()


def request(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


BATCH = [
    request("chat-1", "/v1/chat/completions", {"model": "lm", "max_tokens": 5,
            "messages": [{"role": "user", "content": "Hello world!"}]}),
    request("text-1", "/v1/completions", {"model": "lm", "prompt": "Once upon", "max_tokens": 4}),
    "",  # blank: skipped, as vLLM's
    request("embed-1", "/v1/embeddings", {"model": "embed", "input": ["a dog", "a cat"]}),
    '{"custom_id": "broken", "method": "POST", "url": "/v1/chat/comp',
    request("odd-url", "/v1/moderations", {"model": "lm", "input": "x"}),
    request("no-model", "/v1/chat/completions", {"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]}),
    request("streamed", "/v1/chat/completions", {"model": "lm", "stream": True, "messages": [
        {"role": "user", "content": "hi"}]}),
    request("embed-llm", "/v1/embeddings", {"model": "lm", "input": "x"}),
]  # fmt: skip


def check_batch(lines: list[dict[str, Any]]) -> None:
    """BATCH's answers: each in vLLM's shape, in order; those that can be answered are."""
    assert [line["custom_id"] for line in lines] == [
        "chat-1",
        "text-1",
        "embed-1",
        None,
        "odd-url",
        "no-model",
        "streamed",
        "embed-llm",
    ]
    by_id = {line["custom_id"]: line for line in lines}
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert set(line["response"]) == {"status_code", "request_id", "body"}
        assert (line["error"] is None) == (line["response"]["status_code"] == 200)
        assert (line["response"]["body"] is None) == (line["error"] is not None)
    answer = by_id["chat-1"]["response"]["body"]
    assert answer["object"] == "chat.completion" and answer["model"] == "lm"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] == 5  # a random model: it runs to the limit
    text = by_id["text-1"]["response"]["body"]
    assert text["object"] == "text_completion" and text["usage"]["completion_tokens"] == 4
    vectors = by_id["embed-1"]["response"]["body"]
    assert [d["index"] for d in vectors["data"]] == [0, 1]
    assert len(vectors["data"][0]["embedding"]) == 32
    codes = {cid: (by_id[cid]["response"]["status_code"], by_id[cid]["error"]["error"]["code"])
             for cid in ("odd-url", "no-model", "streamed", "embed-llm")}  # fmt: skip
    assert codes == {"odd-url": (404, "not_found"), "no-model": (404, "model_not_found"),
                     "streamed": (400, "invalid_request"),
                     "embed-llm": (400, "invalid_request")}  # fmt: skip
    assert "/v1/chat/completions" in by_id["odd-url"]["error"]["error"]["message"]
    assert "not JSON" in lines[3]["error"]["error"]["message"]
    # refused before a worker is asked (it would generate for the texts)
    assert "generates text" in by_id["embed-llm"]["error"]["error"]["message"]


def test_the_command_line_answers_a_file(fleet_url: str, tmp_path: Path) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(BATCH) + "\n")
    code = cli.main(["run-batch", "--redis-url", fleet_url, "-i", str(source), "-o",
                     str(target), "--progress-interval", "0"])  # fmt: skip
    assert code == 1  # some lines are error lines
    check_batch([json.loads(line) for line in target.read_text().splitlines()])
    # every line good: 0
    source.write_text(BATCH[0] + "\n")
    assert cli.main(["run-batch", "--redis-url", fleet_url, "-i", str(source), "-o",
                     str(target), "--progress-interval", "0"]) == 0  # fmt: skip


def test_stdin_to_stdout(
    fleet_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(BATCH[:2]) + "\n"))
    assert cli.main(["run-batch", "--redis-url", fleet_url, "-i", "-", "-o", "-"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["custom_id"] for line in lines] == ["chat-1", "text-1"]
    assert "2 lines answered, 0 with an error" in captured.err


class Files(http.server.BaseHTTPRequestHandler):
    """GET serves ``held[path]``; PUT stores the body there (``fail`` PUTs answered 500)."""

    held: dict[str, bytes] = {}
    fail = 0

    def do_GET(self) -> None:
        data = self.held.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if Files.fail:
            Files.fail -= 1
            self.send_response(500)
        else:
            self.held[self.path] = data
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def files() -> Iterator[Callable[[str], str]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Files.held, Files.fail = {}, 0
    yield lambda path: f"http://127.0.0.1:{server.server_port}{path}"
    server.shutdown()
    server.server_close()


def test_http_input_and_output_urls(
    fleet_url: str, files: Callable[[str], str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    Files.held["/in.jsonl"] = ("\n".join(BATCH) + "\n").encode()
    args = ["run-batch", "--redis-url", fleet_url, "-i", files("/in.jsonl"), "-o",
            files("/out.jsonl"), "--output-tmp-dir", str(tmp_path), "--progress-interval", "0"]  # fmt: skip
    assert cli.main(args) == 1
    check_batch([json.loads(line) for line in Files.held["/out.jsonl"].splitlines()])
    assert list(tmp_path.iterdir()) == []  # the temporary file, removed once uploaded
    # an upload that keeps failing: the output is kept, and said where
    monkeypatch.setattr("batchfleet.batch_files.UPLOAD_DELAY_S", 0.0)
    Files.fail = 5
    assert cli.main(args) == 1
    (kept,) = tmp_path.iterdir()
    assert str(kept) in capsys.readouterr().err
    check_batch([json.loads(line) for line in kept.read_text().splitlines()])
    # an input that cannot be read: 2, before anything is written
    assert cli.main([*args[:4], files("/missing.jsonl"), *args[5:]]) == 2
    assert "cannot read" in capsys.readouterr().err
