"""``batchfleet run-batch``'s https input and output (a local TLS server: the certificate
verified as vLLM's aiohttp verifies it, against the system's CAs or ``SSL_CERT_FILE``; an
upload answered 503 tried again). Redis failing: ``test_run_batch_outage.py``."""

from __future__ import annotations

import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
import trustme
from gateway_fakes import ScriptedWorker

from batchfleet import cli

pytestmark = pytest.mark.timeout(120)


def chat(custom_id: str) -> str:
    body = {"model": "mm", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": "POST",
                       "url": "/v1/chat/completions", "body": body})  # fmt: skip


def gen() -> dict[str, Any]:
    return {"text": "Hi!", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2}


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
