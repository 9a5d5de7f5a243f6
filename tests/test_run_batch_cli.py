"""``batchfleet run-batch`` as a process, the test playing the worker: Ctrl-C (SIGINT)
mid-run, the progress lines on stderr, and the Prometheus server of ``--enable-metrics``
(vLLM's run-batch flags). Every wait is for an event (a request taken, a line printed, a
metric scraped), each with a hang guard far past it; nothing is timed."""

from __future__ import annotations

import http.server
import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from batch_process import GUARD_S, RunBatch, take
from gateway_fakes import ScriptedWorker

from batchfleet.redis_server import free_port

pytestmark = pytest.mark.timeout(180)


def chat(custom_id: str) -> str:
    """A chat line whose fleet request id is its custom_id (the body's request_id)."""
    body = {"model": "mm", "request_id": custom_id, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": "POST",
                       "url": "/v1/chat/completions", "body": body})  # fmt: skip


def gen() -> dict[str, Any]:
    return {"text": "Hi!", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2}


@pytest.fixture
def fake(redis_url: str) -> Iterator[ScriptedWorker]:
    client = redis.Redis.from_url(redis_url)
    yield ScriptedWorker(client, "mm")
    client.close()


@pytest.fixture
def start(redis_url: str, tmp_path: Path) -> Iterator[Callable[..., RunBatch]]:
    runs: list[RunBatch] = []

    def run(lines: list[str], *flags: str, target: str | None = None) -> RunBatch:
        (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
        runs.append(RunBatch(redis_url, tmp_path / "in.jsonl", target or tmp_path / "out.jsonl",
                             *flags))  # fmt: skip
        return runs[-1]

    yield run
    for run_ in runs:
        run_.kill()


def test_ctrl_c_cancels_the_lines_in_flight_and_keeps_those_written_whole(
    fake: ScriptedWorker, start: Callable[..., RunBatch], tmp_path: Path
) -> None:
    # Given a run of three lines, all sent, the first answered and written
    run = start([chat("line-a"), chat("line-b"), chat("line-c")], "--progress-interval", "0.05")
    taken = {t.id: t for t in (take(fake), take(fake), take(fake))}
    assert sorted(taken) == ["line-a", "line-b", "line-c"]
    fake.ok(taken["line-a"], [gen()])
    # (its progress lines say so as they come)
    run.wait_for(r"run-batch: 3 lines read, 1 written \(0 failed\), 2 in flight, \d+ s$")
    # When it is stopped with Ctrl-C
    run.proc.send_signal(signal.SIGINT)
    code, stderr = run.end()
    # Then it exits 130 at once (an hour's --timeout not waited), saying what it did
    assert code == 130, stderr
    assert (
        "stopped; the lines in flight were cancelled (the log names any not: Redis "
        "unreachable), those written are kept" in stderr
    )
    assert re.search(r"run-batch: end: 3 lines read, 1 written \(0 failed\), 0 in flight", stderr)
    # and the lines in flight are cancelled in the fleet, not the one answered
    assert [fake.cancelled(taken[i]) for i in ("line-a", "line-b", "line-c")] == [
        False, True, True]  # fmt: skip
    # and the output holds the line answered, whole, and nothing else
    text = (tmp_path / "out.jsonl").read_text()
    assert text.endswith("\n")
    (line,) = [json.loads(line) for line in text.splitlines()]
    assert (line["custom_id"], line["response"]["status_code"]) == ("line-a", 200)


class Uploads(http.server.BaseHTTPRequestHandler):
    """Counts the PUTs it takes (answered 200)."""

    puts = 0

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        Uploads.puts += 1
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_ctrl_c_with_an_output_url_uploads_nothing_and_keeps_what_was_written(
    fake: ScriptedWorker, start: Callable[..., RunBatch], tmp_path: Path
) -> None:
    # Given a run writing to a URL, one line answered and one in flight
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Uploads)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Uploads.puts = 0
    url = f"http://127.0.0.1:{server.server_port}/out.jsonl"
    (tmp_path / "tmp").mkdir()
    run = start([chat("line-a"), chat("line-b")], "--progress-interval", "0.05",
                "--output-tmp-dir", str(tmp_path / "tmp"), target=url)  # fmt: skip
    taken = {t.id: t for t in (take(fake), take(fake))}
    fake.ok(taken["line-a"], [gen()])
    run.wait_for(r"run-batch: 2 lines read, 1 written")
    # When it is stopped with Ctrl-C
    run.proc.send_signal(signal.SIGINT)
    code, stderr = run.end()
    server.shutdown()
    server.server_close()
    # Then nothing is uploaded (a part would pass for the whole); the part is kept, named
    assert code == 130, stderr
    assert Uploads.puts == 0 and fake.cancelled(taken["line-b"])
    (kept,) = (tmp_path / "tmp").iterdir()
    assert f"not uploaded to {url}; the output so far is kept in {kept}" in stderr
    (line,) = [json.loads(line) for line in kept.read_text().splitlines()]
    assert line["custom_id"] == "line-a"


class Stalls(http.server.BaseHTTPRequestHandler):
    """GET: ``asked`` set, then held open until ``release`` (the hang guard at most). PUT:
    ``put`` set, answered 503 (an upload that will not go through)."""

    asked = threading.Event()
    release = threading.Event()
    put = threading.Event()

    def do_GET(self) -> None:
        Stalls.asked.set()
        Stalls.release.wait(GUARD_S)
        self.send_response(404)
        self.end_headers()

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        Stalls.put.set()
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stalls() -> Iterator[str]:
    """A :class:`Stalls` server's base URL."""
    for event in (Stalls.asked, Stalls.release, Stalls.put):
        event.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stalls)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    Stalls.release.set()
    server.shutdown()
    server.server_close()


def test_ctrl_c_while_the_input_url_is_opened_exits_130_writing_nothing(
    redis_url: str, stalls: str, tmp_path: Path
) -> None:
    # Given a run whose input URL is slow to answer
    run = RunBatch(redis_url, f"{stalls}/in.jsonl", tmp_path / "out.jsonl")
    try:
        assert Stalls.asked.wait(GUARD_S)
        # When it is stopped with Ctrl-C before the run starts
        run.proc.send_signal(signal.SIGINT)
        code, stderr = run.end()
    finally:
        run.kill()
    # Then it exits 130 saying so, no traceback, nothing written (no output file)
    assert code == 130, stderr
    assert "Traceback" not in stderr
    assert "stopped before the run started; nothing written" in stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_ctrl_c_during_the_upload_retries_keeps_the_output_and_names_it(
    start: Callable[..., RunBatch], stalls: str, tmp_path: Path
) -> None:
    # Given a run whose upload is answered 503 (tried again 5 s later)
    (tmp_path / "tmp").mkdir()
    url = f"{stalls}/out.jsonl"
    run = start(["{broken"], "--progress-interval", "0", "--output-tmp-dir",
                str(tmp_path / "tmp"), target=url)  # fmt: skip
    assert Stalls.put.wait(GUARD_S)
    # When it is stopped with Ctrl-C between the tries
    run.proc.send_signal(signal.SIGINT)
    code, stderr = run.end()
    # Then it exits 130, the whole output kept in its temporary file, which the log names
    assert code == 130, stderr
    (kept,) = (tmp_path / "tmp").iterdir()
    assert f"upload to {url} stopped; the output is kept in {kept}" in stderr
    (line,) = [json.loads(line) for line in kept.read_text().splitlines()]
    assert line["response"]["status_code"] == 400


@pytest.mark.parametrize(("interval", "last"), [("3600", True), ("0", False)])
def test_a_run_shorter_than_the_progress_interval_prints_its_last_progress_line(
    fake: ScriptedWorker, start: Callable[..., RunBatch], interval: str, last: bool
) -> None:
    run = start([chat("line-a"), "{broken"], "--progress-interval", interval)
    fake.ok(take(fake), [gen()])
    code, stderr = run.end()
    assert code == 1, stderr  # (the broken line is an error line)
    progress = [line for line in stderr.splitlines() if " lines read, " in line]
    if last:  # its only one: the run's end, what was written
        (line,) = progress
        assert re.search(r"run-batch: end: 2 lines read, 2 written \(1 failed\), 0 in flight, "
                         r"\d+ s$", line), line  # fmt: skip
    else:  # 0: none at all
        assert progress == []
    assert re.search(
        r"2 lines answered, 1 with an error, to \S+out\.jsonl$", stderr.splitlines()[-1]
    )  # (the summary, last)


def scrape(port: int) -> dict[str, float]:
    """The samples of run-batch's own metrics at ``port``, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines()
               if line.startswith(("batchfleet_", "vllm:")))  # fmt: skip
    return {name: float(value) for name, value in samples}


def test_enable_metrics_serves_the_run_s_metrics_while_it_lasts(
    fake: ScriptedWorker, start: Callable[..., RunBatch]
) -> None:
    # Given a run with --enable-metrics: a line answered, one held, one not JSON
    port = free_port()
    run = start([chat("line-a"), chat("line-b"), "{broken"], "--progress-interval", "0",
                "--enable-metrics", "--url", "127.0.0.1", "--port", str(port))  # fmt: skip
    taken = {t.id: t for t in (take(fake), take(fake))}
    fake.ok(taken["line-a"], [gen()])
    # When it is scraped once the answered line is counted
    ok = 'batchfleet_run_batch_lines_answered_total{code="",status="200"}'
    guard = time.monotonic() + GUARD_S
    while (metrics := scrape(port)).get(ok) != 1:
        assert time.monotonic() < guard, metrics
    # Then it shows the lines read, answered by status and code, and in flight
    assert metrics["batchfleet_run_batch_lines_read_total"] == 3
    assert metrics[ok] == 1
    assert metrics['batchfleet_run_batch_lines_answered_total{code="invalid_request",'
                   'status="400"}'] == 1  # fmt: skip
    assert metrics["batchfleet_run_batch_lines_in_flight"] == 1
    assert metrics["batchfleet_run_batch_line_duration_seconds_count"] == 1
    assert metrics["batchfleet_run_batch_queue_full_retries_total"] == 0
    assert metrics["batchfleet_run_batch_redis_reachable"] == 1
    # and the fleet's queue gauges of its model, vLLM's among them: line-b is running
    # (read by the worker, not answered), none waits (each read at its next read of Redis)
    running = 'vllm:num_requests_running{engine="fleet",model_name="mm"}'
    while (metrics := scrape(port)).get(running) != 1:
        assert time.monotonic() < guard, metrics
    assert metrics['vllm:num_requests_waiting{engine="fleet",model_name="mm"}'] == 0
    assert metrics['batchfleet_stream_pending{lane="1",model="mm"}'] == 1
    # and once the run ends, nothing is served
    fake.ok(taken["line-b"], [gen()])
    code, stderr = run.end()
    assert code == 1, stderr
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_metrics_that_cannot_be_served_stop_the_run_before_it_starts(
    start: Callable[..., RunBatch], tmp_path: Path
) -> None:
    import socket

    with socket.socket() as taken_port:
        taken_port.bind(("127.0.0.1", 0))
        taken_port.listen()
        port = taken_port.getsockname()[1]
        run = start([chat("line-a")], "--enable-metrics", "--url", "127.0.0.1", "--port",
                    str(port))  # fmt: skip
        code, stderr = run.end()
    assert code == 2, stderr
    assert f"cannot serve metrics at ('127.0.0.1', {port})" in stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_a_port_out_of_range_is_refused_as_a_bad_argument(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from batchfleet import cli

    code = cli.main(["run-batch", "--redis-url", "redis://127.0.0.1:1/0", "-i", "x", "-o",
                     str(tmp_path / "out.jsonl"), "--enable-metrics", "--port", "70000"])  # fmt: skip
    assert code == 2
    assert "--port must be 0 to 65535, not 70000" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
