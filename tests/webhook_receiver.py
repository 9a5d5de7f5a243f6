"""A real local HTTP(S) webhook receiver for the tests, with scripted answers."""

from __future__ import annotations

import contextlib
import http.server
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from batchfleet.redis_server import free_port


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Answer:
    """What to answer one request: status, headers, body, or sleep first (``hang_s``).

    ``drip_s`` sends the answer one byte at a time, waiting that long before each byte: from
    the status line on, or only the body when ``drip_body_only``.
    """

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    hang_s: float = 0.0
    drip_s: float = 0.0
    drip_body_only: bool = False


class Receiver:
    """``with Receiver() as rx:`` serves on 127.0.0.1 (a free port) until the block ends.

    Answers come from ``script`` (one per request, in order), then ``default``. Every request
    is recorded in ``received``; ``connections`` counts accepted TCP connections. ``cut_off``
    is set when the client closed the connection before a dripped answer was all sent.
    """

    def __init__(
        self,
        script: list[Answer] | None = None,
        default: Answer | None = None,
        *,
        port: int | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.script = list(script or [])
        self.default = default or Answer()
        self.port = port or free_port()
        self.tls = tls
        self.received: list[Received] = []
        self.connections = 0
        self.arrived = threading.Event()
        self.closing = threading.Event()
        self.cut_off = threading.Event()
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None
        self.on_request: Callable[[Received], None] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/hook"

    def _answer(self) -> Answer:
        with self._lock:
            return self.script.pop(0) if self.script else self.default

    def start(self) -> Receiver:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                got = Received(
                    self.path, dict(self.headers.items()), self.rfile.read(length), time.time()
                )
                with outer._lock:
                    outer.received.append(got)
                outer.arrived.set()
                answer = outer._answer()
                if answer.hang_s:
                    outer.closing.wait(answer.hang_s)  # ends early when the test closes
                if answer.drip_s:
                    self._drip(answer)
                    return
                self.send_response(answer.status)
                for k, v in answer.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(answer.body)

            def _drip(self, answer: Answer) -> None:
                head = f"HTTP/1.1 {answer.status} X\r\nContent-Length: {len(answer.body)}\r\n"
                head += "".join(f"{k}: {v}\r\n" for k, v in answer.headers.items()) + "\r\n"
                dripped = answer.body if answer.drip_body_only else head.encode() + answer.body
                try:
                    if answer.drip_body_only:
                        self.wfile.write(head.encode())
                    for i in range(len(dripped)):
                        if outer.closing.wait(answer.drip_s):
                            return
                        self.wfile.write(dripped[i : i + 1])
                except OSError:
                    outer.cut_off.set()
                self.close_connection = True

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def get_request(self):  # type: ignore[no-untyped-def]
                sock, addr = super().get_request()
                outer.connections += 1
                if outer.tls is not None:
                    sock = outer.tls.wrap_socket(sock, server_side=True)
                return sock, addr

        self._server = Server(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.closing.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for(self, count: int, timeout: float) -> list[Received]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if len(self.received) >= count:
                    return list(self.received)
            time.sleep(0.02)
        raise TimeoutError(f"{len(self.received)} of {count} deliveries within {timeout}s")
