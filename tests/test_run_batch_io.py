"""``batchfleet run-batch`` where its surroundings fail: Redis gone (the gateway's 503, as
an error line; a line waiting for its result rides out an outage for ``retry_for_s``,
then is a 503 line; unreachable from the start, exit 1), and https input and output (a local
TLS server: the certificate verified as vLLM's aiohttp verifies it, against the system's
CAs or ``SSL_CERT_FILE``; an upload answered 503 tried again)."""

from __future__ import annotations

import asyncio
import http.server
import json
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
import trustme
from gateway_fakes import ScriptedWorker, Taken

from batchfleet import cli
from batchfleet.redis_server import LocalRedis, free_port
from batchfleet.run_batch import Settings, run_batch

pytestmark = pytest.mark.timeout(120)

GUARD_S = 60.0
"""How long a wait may last before the test calls it a hang (each ends far sooner)."""


def chat(custom_id: str) -> str:
    body = {"model": "mm", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": "POST",
                       "url": "/v1/chat/completions", "body": body})  # fmt: skip


def gen() -> dict[str, Any]:
    return {"text": "Hi!", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2}


# --- Redis down ------------------------------------------------------------------------------


def test_a_line_sent_while_redis_is_down_is_a_503_line_and_the_run_goes_on() -> None:
    # Given a run whose Redis stops once it has started (connected, subscribed)
    server = LocalRedis()
    url = server.start()
    client = redis.Redis.from_url(url)
    ScriptedWorker(client, "mm")  # (the model's lanes)
    client.close()

    async def lines() -> AsyncIterator[str]:
        server.stop()  # When Redis goes away before the lines are sent
        yield chat("a") + "\n"
        yield chat("b") + "\n"

    out: list[str] = []
    try:
        summary = asyncio.run(run_batch(url, lines(), out.append, Settings(progress_s=0)))
    finally:
        server.stop()
    # Then each line is answered as the gateway answers then: 503, unavailable
    assert (summary.lines, summary.failed) == (2, 2)
    answers = [json.loads(line) for line in out]
    assert [a["custom_id"] for a in answers] == ["a", "b"]
    for answer in answers:
        assert answer["response"]["status_code"] == 503 and answer["response"]["body"] is None
        assert answer["error"]["error"]["code"] == "unavailable"
        assert answer["error"]["error"]["message"].startswith("Redis unreachable: ")


def waited(fake: ScriptedWorker, url: str) -> Taken:
    """The next request taken, once the run waits for its result: it reads its result key
    (at once, or again at its next sweep, 2 s on), as MONITOR shows."""
    taken = fake.take()
    with redis.Redis.from_url(url).monitor() as monitor:
        for command in monitor.listen():
            if command["command"].startswith("GET ") and taken.id in command["command"]:
                return taken
    raise AssertionError("MONITOR ended")


def run_one_line_while(server: LocalRedis, outage: Any, retry_for_s: float) -> dict[str, Any]:
    """One chat line run through the fleet at ``server`` (default ``--timeout``: an hour);
    once it waits for its result, ``outage(taken, worker)`` plays the rest in a thread.
    Its output line."""
    client = redis.Redis.from_url(server.url)
    fake = ScriptedWorker(client, "mm")
    worker = threading.Thread(target=lambda: outage(waited(fake, server.url), fake))
    worker.start()

    async def lines() -> AsyncIterator[str]:
        yield chat("a") + "\n"

    out: list[str] = []
    settings = Settings(progress_s=0, retry_for_s=retry_for_s)
    try:
        asyncio.run(asyncio.wait_for(run_batch(server.url, lines(), out.append, settings),
                                     GUARD_S))  # fmt: skip
    finally:
        worker.join(GUARD_S)
        client.close()
        server.stop()
    (line,) = [json.loads(line) for line in out]
    return dict(line)


def test_a_line_waiting_when_redis_goes_away_for_good_is_a_503_line_after_retry_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a line waiting for its result; When Redis then goes away and stays away
    server = LocalRedis()
    server.start()
    line = run_one_line_while(server, lambda taken, fake: server.crash(), retry_for_s=0.5)
    # Then after retry_for_s (not --timeout's hour) the line is a 503 unavailable line
    assert line["response"]["status_code"] == 503 and line["response"]["body"] is None
    error = line["error"]["error"]
    assert error["code"] == "unavailable"
    assert error["message"].startswith(f"cannot reach Redis at {server.url}: ")
    # and its cancel is not tried (it would ride out the retries in vain): logged
    assert f"Redis unreachable: requests {line['response']['request_id']} not cancelled" in (
        caplog.text)  # fmt: skip


def test_a_line_waiting_when_redis_restarts_within_retry_for_is_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a line waiting for its result, on a Redis that keeps its data on disk
    server = LocalRedis(appendonly=True, appendfsync="always")
    server.start()

    def outage(taken: Taken, fake: ScriptedWorker) -> None:
        # When Redis goes away, the run sees it, and it comes back on the same port
        server.crash()
        end = time.monotonic() + GUARD_S
        while "run-batch: Redis unreachable" not in caplog.text and time.monotonic() < end:
            time.sleep(0.05)
        server.start()
        fake.ok(taken, [gen()])  # (the worker answers after the restart)

    line = run_one_line_while(server, outage, retry_for_s=GUARD_S)
    # Then the line is answered as if nothing happened
    assert line["error"] is None, line
    assert line["response"]["status_code"] == 200
    assert line["response"]["body"]["choices"][0]["message"]["content"] == "Hi!"


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


# --- https -----------------------------------------------------------------------------------


class Files(http.server.BaseHTTPRequestHandler):
    """GET serves ``held[path]``; PUT stores the body there, the first ``busy`` PUTs
    answered 503 (each PUT counted in ``puts``)."""

    held: ClassVar[dict[str, bytes]] = {}
    busy: ClassVar[int] = 0
    puts: ClassVar[int] = 0

    def do_GET(self) -> None:
        data = self.held.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        Files.puts += 1
        if Files.busy:
            Files.busy -= 1
            self.send_response(503)
        else:
            self.held[self.path] = data
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An https file server on 127.0.0.1 (``localhost``'s certificate by a new CA), and
    that CA's certificate file."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(context)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Files.held, Files.busy, Files.puts = {}, 0, 0
    yield f"https://localhost:{server.server_port}", ca_file
    server.shutdown()
    server.server_close()


def test_https_input_and_output_verified_against_ssl_cert_file_and_retried_on_503(
    redis_url: str, tls: tuple[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    base, ca_file = tls
    Files.held["/in.jsonl"] = (chat("a") + "\n{broken\n").encode()
    args = ["run-batch", "--redis-url", redis_url, "-i", f"{base}/in.jsonl", "-o",
            f"{base}/out.jsonl", "--output-tmp-dir", str(tmp_path / "tmp"), "--progress-interval",
            "0"]  # fmt: skip
    (tmp_path / "tmp").mkdir()
    # Given a server whose certificate the system's CAs do not vouch for: refused, exit 2
    assert cli.main(args) == 2
    assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err
    # When its CA is named by SSL_CERT_FILE (as for vLLM's aiohttp), and the first upload
    # is answered 503
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    monkeypatch.setattr("batchfleet.batch_files.UPLOAD_DELAY_S", 0.0)
    Files.busy = 1
    client = redis.Redis.from_url(redis_url)
    fake = ScriptedWorker(client, "mm")
    worker = threading.Thread(target=lambda: fake.ok(fake.take(), [gen()]))
    worker.start()
    code = cli.main(args)
    worker.join()
    client.close()
    # Then the input is read, the output uploaded at the second try, the temporary removed
    assert code == 1, capsys.readouterr().err  # (the broken line)
    assert Files.puts == 2
    good, bad = [json.loads(line) for line in Files.held["/out.jsonl"].splitlines()]
    assert (good["custom_id"], good["response"]["status_code"]) == ("a", 200)
    assert bad["response"]["status_code"] == 400
    assert list((tmp_path / "tmp").iterdir()) == []
    assert "upload 1 to https://localhost" in caplog.text  # (its warning)
