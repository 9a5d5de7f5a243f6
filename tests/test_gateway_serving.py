"""How the gateway is served (vLLM's ``--ssl-*``, ``--allowed-*``, ``--root-path``,
``--uds``): HTTPS verified by a client, mutual TLS, a certificate replaced while serving,
CORS preflights and answers, a root path, a Unix socket; the real gateway in-process."""

from __future__ import annotations

import asyncio
import os
import ssl
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import tornado.web
import trustme
from batchfleet.producer.gateway.cors import Cors
from batchfleet.producer.gateway.frontend import Frontend
from batchfleet.producer.gateway.serving import Rooted, Tls, listen
from gateway_fakes import GATEWAY_KEY, gateway_in_process
from tornado.httputil import HTTPHeaders, HTTPServerRequest, RequestStartLine

from batchfleet import cli
from batchfleet.gateway_flags import serving_options
from batchfleet.redis_server import free_port

Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
ORIGIN = "https://app.example"


async def call(
    opener: Opener, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.0 request on the connection ``opener`` makes: status, headers, body."""
    reader, writer = await opener()
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(f"{method} {path} HTTP/1.0\r\n{head}Content-Length: 0\r\n\r\n".encode())
    response = await reader.read()
    writer.close()
    top, _, body = response.partition(b"\r\n\r\n")
    status, *lines = top.decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines)
    return int(status.split()[1]), {k.lower(): v for k, v in fields.items()}, body


def tcp(port: int, ctx: ssl.SSLContext | None = None) -> Opener:
    return lambda: asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                           server_hostname="localhost" if ctx else None)  # fmt: skip


KEY = {"Authorization": f"Bearer {GATEWAY_KEY}"}


async def models(port: int, origin: str, key: bool = True) -> tuple[int, dict[str, str], bytes]:
    """GET /v1/models from a page of ``origin`` (with the key, or none)."""
    return await call(tcp(port), "GET", "/v1/models", (KEY if key else {}) | {"Origin": origin})


def server_files(ca: trustme.CA, where: Path, name: str = "server") -> Tls:
    """A certificate for localhost by ``ca``, written to ``where``."""
    cert = ca.issue_cert("localhost", "127.0.0.1", common_name=name)
    chain, key = where / "chain.pem", where / "key.pem"
    cert.private_key_pem.write_to_path(str(key))
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return Tls(str(chain), str(key))


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


def test_https_is_verified_by_a_client_and_plain_http_gets_no_answer(
    redis_url: str, tmp_path: Path
) -> None:
    ca = trustme.CA()
    tls = server_files(ca, tmp_path)

    async def go() -> None:
        async with gateway_in_process(redis_url, tls=tls) as port:
            status, _, body = await call(tcp(port, client_context(ca)), "GET", "/version")
            assert status == 200 and b"version" in body
            # a client that trusts another CA refuses the gateway's certificate
            with pytest.raises(ssl.SSLCertVerificationError):
                await call(tcp(port, client_context(trustme.CA())), "GET", "/version")
            # plain HTTP on the TLS port is not answered (the connection is reset)
            with pytest.raises(ConnectionError):
                await call(tcp(port), "GET", "/version")

    asyncio.run(go())


def test_mutual_tls_refuses_a_client_without_a_certificate(redis_url: str, tmp_path: Path) -> None:
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    base = server_files(ca, tmp_path)
    tls = Tls(base.certfile, base.keyfile, ca_certs=str(ca_file), cert_reqs=ssl.CERT_REQUIRED)

    async def go() -> None:
        async with gateway_in_process(redis_url, tls=tls) as port:
            anonymous = client_context(ca)
            with pytest.raises((ssl.SSLError, ConnectionError)):
                # TLS 1.3: the refusal arrives after the client's handshake, on reading
                status, _, _ = await call(tcp(port, anonymous), "GET", "/version")
                assert status != 200
            signed = client_context(ca)
            ca.issue_cert("client@example").configure_cert(signed)
            assert (await call(tcp(port, signed), "GET", "/version"))[0] == 200
            # a certificate by another CA is refused too
            stranger = client_context(ca)
            trustme.CA().issue_cert("client@example").configure_cert(stranger)
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await call(tcp(port, stranger), "GET", "/version")

    asyncio.run(go())


class Hello(tornado.web.RequestHandler):
    def get(self) -> None:
        self.write("hello")


def test_a_replaced_certificate_is_served_once_checked(tmp_path: Path) -> None:
    ca = trustme.CA()
    first = server_files(ca, tmp_path, "first")
    tls = Tls(first.certfile, first.keyfile, refresh=True)
    chain, key = Path(first.certfile), Path(first.keyfile)
    old_chain, old_key = chain.read_bytes(), key.read_bytes()

    async def served_name(port: int) -> str:
        _, writer = await tcp(port, client_context(ca))()
        cert: Any = writer.get_extra_info("peercert")
        writer.close()
        return str(dict(x[0] for x in cert["subject"])["commonName"])

    async def go() -> None:
        port = free_port()
        server = listen(tornado.web.Application([("/", Hello)]), host="127.0.0.1", port=port,
                        tls=tls)  # fmt: skip
        refresher = server.refresher
        assert refresher is not None
        try:
            assert await served_name(port) == "first"
            assert not refresher.check()  # nothing changed
            # Given a rotation caught half done: the new chain, the old key
            (tmp_path / "next").mkdir()
            second = server_files(ca, tmp_path / "next", "second")
            chain.write_bytes(Path(second.certfile).read_bytes())
            # Then it does not load, and the old certificate is still served
            assert not refresher.check()
            assert await served_name(port) == "first"
            # Once the key is there too, the new certificate is served
            key.write_bytes(Path(str(second.keyfile)).read_bytes())
            assert refresher.check()
            assert await served_name(port) == "second"
            # and back
            chain.write_bytes(old_chain)
            key.write_bytes(old_key)
            os.utime(chain, ns=(0, 10**9))  # a change of mtime alone is seen too
            assert refresher.check()
            assert await served_name(port) == "first"
        finally:
            server.close()

    asyncio.run(go())


def test_cors_preflight_and_answers_for_listed_origins(redis_url: str) -> None:
    async def go() -> None:
        async with gateway_in_process(redis_url, cors=Cors((ORIGIN,))) as port:
            asks = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
            # a preflight needs no key (browsers send none), on any path
            for path in ("/v1/chat/completions", "/nowhere"):
                status, headers, body = await call(tcp(port), "OPTIONS", path, asks)
                assert (status, body) == (200, b"OK"), path
                assert headers["access-control-allow-origin"] == ORIGIN
                assert headers["vary"] == "Origin"
                assert "POST" in headers["access-control-allow-methods"]
                assert headers["access-control-allow-headers"] == "authorization, content-type"
                assert "access-control-allow-credentials" not in headers
            # another origin is refused, without the allow header
            evil = asks | {"Origin": "https://evil.example"}
            status, headers, body = await call(tcp(port), "OPTIONS", "/v1/models", evil)
            assert (status, body) == (400, b"Disallowed CORS origin")
            assert "access-control-allow-origin" not in headers
            # answers carry the origin where it is listed, errors too (a page reads a 401)
            status, headers, _ = await models(port, ORIGIN)
            assert (status, headers["access-control-allow-origin"]) == (200, ORIGIN)
            status, headers, _ = await models(port, ORIGIN, key=False)
            assert (status, headers["access-control-allow-origin"]) == (401, ORIGIN)
            status, headers, _ = await models(port, "https://evil.example")
            assert status == 200 and "access-control-allow-origin" not in headers
            # an OPTIONS that is no preflight is no way around the key either: 405
            assert (await call(tcp(port), "OPTIONS", "/v1/models"))[0] == 405

    asyncio.run(go())


def test_cors_any_origin_with_credentials_echoes_the_origin(redis_url: str) -> None:
    async def go() -> None:
        cors = Cors(("*",), ("GET", "POST"), ("Authorization",), credentials=True)
        async with gateway_in_process(redis_url, cors=cors) as port:
            asks = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "Authorization"}  # fmt: skip
            status, headers, _ = await call(tcp(port), "OPTIONS", "/v1/completions", asks)
            assert status == 200
            assert headers["access-control-allow-origin"] == ORIGIN  # "*" is no credential's
            assert headers["access-control-allow-credentials"] == "true"
            assert headers["access-control-allow-headers"] == (
                "Accept, Accept-Language, Authorization, Content-Language, Content-Type"
            )
            for refused, why in (({"Access-Control-Request-Method": "DELETE"}, b"method"),
                                 ({"Access-Control-Request-Headers": "X-Other"}, b"headers")):  # fmt: skip
                status, _, body = await call(tcp(port), "OPTIONS", "/v1/completions",
                                             asks | refused)  # fmt: skip
                assert (status, body) == (400, b"Disallowed CORS " + why)
            status, headers, _ = await models(port, ORIGIN)
            assert headers["access-control-allow-origin"] == ORIGIN
            assert headers["vary"] == "Origin"
            assert headers["access-control-allow-credentials"] == "true"

    asyncio.run(go())


def test_no_cors_headers_by_default(redis_url: str) -> None:
    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            asks = {"Origin": ORIGIN, "Access-Control-Request-Method": "GET"}
            status, headers, _ = await call(tcp(port), "OPTIONS", "/v1/models", asks)
            assert status == 405
            status, headers, _ = await models(port, ORIGIN)
            assert status == 200
            assert not [h for h in headers if h.startswith("access-control-")]

    asyncio.run(go())


def test_root_path_routes_with_and_without_the_prefix(redis_url: str) -> None:
    async def go() -> None:
        async with gateway_in_process(redis_url, root_path="/llm") as port:
            for path in ("/llm/version", "/version", "/llm/ping"):
                assert (await call(tcp(port), "GET", path))[0] == 200, path
            # the key is asked on the routed path, as without the prefix
            assert (await call(tcp(port), "GET", "/llm/v1/models"))[0] == 401
            assert (await call(tcp(port), "GET", "/llm/v1/models", KEY))[0] == 200
            # a path that only begins with the same letters is not under it
            assert (await call(tcp(port), "GET", "/llmx/version", KEY))[0] == 404

    asyncio.run(go())


def test_unix_socket_is_served_and_removed_on_shutdown(redis_url: str, tmp_path: Path) -> None:
    sock = tmp_path / "gw.sock"
    sock.write_bytes(b"")  # not a socket: refused rather than replaced
    with pytest.raises(ValueError, match="not a socket"):
        listen(tornado.web.Application([]), host="", port=0, uds=str(sock))
    sock.unlink()

    async def go() -> None:
        async with gateway_in_process(redis_url, uds=str(sock)):
            assert stat.S_ISSOCK(sock.stat().st_mode)
            assert stat.S_IMODE(sock.stat().st_mode) == 0o666
            opener = lambda: asyncio.open_unix_connection(str(sock))  # noqa: E731
            status, _, body = await call(opener, "GET", "/version")
            assert status == 200 and b"version" in body
            assert (await call(opener, "GET", "/v1/models", KEY))[0] == 200
        assert not sock.exists()

    asyncio.run(go())


def test_gateway_flags_and_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    def options(*argv: str) -> dict[str, Any]:
        return serving_options(cli.build_parser().parse_args(["gateway", *argv]))

    assert options() == {"tls": None, "cors": None, "root_path": "", "uds": None,
                         "frontend": Frontend()}  # fmt: skip
    got = options("--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2", "--allowed-origins",
                  '["https://a"]', "--allow-credentials", "--root-path", "/llm/")  # fmt: skip
    assert got["tls"] == Tls("c.pem", cert_reqs=2)
    assert got["cors"] == Cors(("https://a",), credentials=True)
    assert got["root_path"] == "/llm"
    # each flag defaults to its BATCHFLEET_ variable
    for name, value in (("SSL_CERTFILE", "e.pem"), ("ENABLE_SSL_REFRESH", "true"),
                        ("ALLOWED_ORIGINS", '["*"]'), ("UDS", "/run/g.sock")):  # fmt: skip
        monkeypatch.setenv(f"BATCHFLEET_{name}", value)
    got = options()
    assert got["tls"] == Tls("e.pem", refresh=True)
    assert got["cors"] == Cors(("*",))
    assert got["uds"] == "/run/g.sock"
    monkeypatch.delenv("BATCHFLEET_SSL_CERTFILE")
    monkeypatch.delenv("BATCHFLEET_ENABLE_SSL_REFRESH")
    # a flag that needs another is refused (the command exits 2)
    for argv, said in ((["--ssl-keyfile", "k"], r"^--ssl-keyfile given without --ssl-certfile"),
                       (["--allowed-origins", "*"], "not a JSON list")):  # fmt: skip
        with pytest.raises(ValueError, match=said):
            options(*argv)
    monkeypatch.setenv("BATCHFLEET_SSL_CERT_REQS", "5")  # as a flag, argparse refuses it
    with pytest.raises(ValueError, match="0, 1 or 2"):
        options("--ssl-certfile", "c")
    monkeypatch.delenv("BATCHFLEET_SSL_CERT_REQS")
    monkeypatch.delenv("BATCHFLEET_ALLOWED_ORIGINS")
    with pytest.raises(ValueError, match=r"^--allow-credentials given without --allowed-origins"):
        options("--allow-credentials")


@pytest.mark.parametrize(("root", "path", "routed"), [
    ("/llm", "/llm/version", "/version"), ("/llm", "/version", "/version"),
    ("/llm", "/llm", "/"), ("/llm", "/llmx/version", "/llmx/version"),
    ("/ver", "/version", "/version"),  # a prefix of the letters only: not under it
    ("/a/b", "/a/b/v1/models", "/v1/models"), ("", "/version", "/version"),
])  # fmt: skip
def test_root_path_strips_only_a_whole_prefix(root: str, path: str, routed: str) -> None:
    app = Rooted([], root_path=root)
    request = HTTPServerRequest(start_line=RequestStartLine("GET", path, "HTTP/1.1"),
                                headers=HTTPHeaders({"Host": "gw"}))  # fmt: skip
    app.find_handler(request)
    assert request.path == routed
