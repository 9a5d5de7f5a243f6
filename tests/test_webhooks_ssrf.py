"""SSRF guard: refused addresses never get a connection; pinning, TLS, redirects, caps."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator

import pytest
import trustme
from batchfleet.webhooks import ssrf
from batchfleet.webhooks.errors import AttemptTimeout, NetworkError, TargetRefused
from batchfleet.webhooks.tasks import classify
from webhook_receiver import Answer, Receiver

STRICT = ssrf.Policy.build()
LOOPBACK_OK = ssrf.Policy.build(["127.0.0.0/8"], allow_http=True)

FAKE_DNS = {
    "public.example": ["93.184.215.14"],
    "internal.example": ["192.168.1.5"],
    "mixed.example": ["93.184.215.14", "10.0.0.7"],
    "metadata.example": ["169.254.169.254"],
    "v6private.example": ["fd12:3456::1"],
    "hooks.test": ["127.0.0.1"],
}


def fake_resolver(calls: list[str] | None = None) -> ssrf.Resolver:
    def resolve(host: str, port: int) -> list[str]:
        if calls is not None:
            calls.append(host)
        if host not in FAKE_DNS:
            raise socket.gaierror(f"unknown host {host}")
        return FAKE_DNS[host]

    return resolve


@pytest.fixture
def no_connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Any outgoing TCP connection attempt is recorded (and fails)."""
    attempts: list[object] = []

    def refuse(self: socket.socket, address: object) -> None:
        attempts.append(address)
        raise AssertionError(f"connection attempted to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    yield attempts


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://127.0.0.1/hook", "loopback"),
        ("https://10.0.0.1/hook", "private"),
        ("https://169.254.169.254/latest/meta-data/", "metadata"),
        ("https://[::1]/hook", "loopback"),
        ("https://[::ffff:127.0.0.1]/hook", "IPv4-mapped loopback"),
        ("https://[::ffff:a9fe:a9fe]/hook", "IPv4-mapped cloud metadata"),
        ("https://internal.example/hook", "private"),
        ("https://mixed.example/hook", "private"),
        ("https://metadata.example/hook", "metadata"),
        ("https://v6private.example/hook", "private"),
        ("https://100.64.0.1/hook", "carrier-grade NAT"),
        ("https://224.0.0.1/hook", "multicast"),
        ("https://[ff02::1]/hook", "multicast"),
        ("https://[fe80::1]/hook", "link-local"),
        ("https://0.0.0.0/hook", "unspecified"),
        ("https://[64:ff9b::a00:1]/hook", "NAT64"),
        ("https://192.0.2.1/hook", "private"),  # documentation range
        ("http://public.example/hook", "scheme"),
        ("ftp://public.example/hook", "scheme"),
        ("https://user:pw@public.example/hook", "credentials"),
    ],
)
def test_refused_without_a_connection(url: str, why: str, no_connections: list[object]) -> None:
    with pytest.raises(TargetRefused, match=why):
        ssrf.send(url, b"{}", {}, STRICT, resolve=fake_resolver())
    assert no_connections == []


def test_a_listening_loopback_server_is_never_contacted_unless_allowlisted() -> None:
    with Receiver() as rx:
        with pytest.raises(TargetRefused, match="loopback"):
            ssrf.send(rx.url.replace("http:", "https:"), b"{}", {}, STRICT)
        with pytest.raises(TargetRefused, match="scheme"):
            ssrf.send(rx.url, b"{}", {}, ssrf.Policy.build(["127.0.0.0/8"]))
        time.sleep(0.1)
        assert rx.connections == 0 and rx.received == []
        assert ssrf.send(rx.url, b"{}", {}, LOOPBACK_OK).status == 200
        assert rx.connections == 1


@pytest.mark.parametrize(
    ("url", "allow", "ip"),
    [
        ("https://public.example/x", [], "93.184.215.14"),
        ("https://93.184.215.14:8443/x", [], "93.184.215.14"),
        ("https://127.0.0.1/x", ["127.0.0.0/8"], "127.0.0.1"),
        ("https://[::1]/x", ["::1"], "::1"),
        ("https://internal.example/x", ["internal.example"], "192.168.1.5"),
        ("https://internal.example/x", ["192.168.0.0/16"], "192.168.1.5"),
    ],
)
def test_allowed_targets_are_pinned_to_the_resolved_address(
    url: str, allow: list[str], ip: str, no_connections: list[object]
) -> None:
    target = ssrf.check_url(url, ssrf.Policy.build(allow), fake_resolver())
    assert str(target.ip) == ip
    assert no_connections == []


def test_an_allowlisted_cidr_does_not_open_other_private_ranges() -> None:
    policy = ssrf.Policy.build(["192.168.0.0/16", "partner.example"])
    with pytest.raises(TargetRefused):
        ssrf.check_url("https://10.0.0.1/x", policy, fake_resolver())
    with pytest.raises(TargetRefused):
        ssrf.check_url("https://metadata.example/x", policy, fake_resolver())


def test_resolved_once_and_connected_to_the_pinned_ip_with_the_original_host() -> None:
    calls: list[str] = []
    with Receiver() as rx:
        url = f"http://hooks.test:{rx.port}/hook?a=1"
        reply = ssrf.send(url, b"{}", {"X-T": "1"}, LOOPBACK_OK, resolve=fake_resolver(calls))
    assert reply.status == 200
    assert calls == ["hooks.test"]
    assert rx.received[0].headers["Host"] == f"hooks.test:{rx.port}"
    assert rx.received[0].path == "/hook?a=1"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _tls_server(ca: trustme.CA, name: str, seen_sni: list[str | None]) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(context)
    context.sni_callback = lambda sock, sni, ctx: seen_sni.append(sni)  # type: ignore[assignment,misc,return-value]
    return context


def test_tls_to_the_pinned_ip_uses_the_hostname_for_sni_and_certificate(ca: trustme.CA) -> None:
    sni: list[str | None] = []
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    with Receiver(tls=_tls_server(ca, "hooks.test", sni)) as rx:
        url = f"https://hooks.test:{rx.port}/hook"
        reply = ssrf.send(
            url, b"{}", {}, LOOPBACK_OK, resolve=fake_resolver(), ssl_context=client_ctx
        )
    assert reply.status == 200
    assert sni == ["hooks.test"]


def test_tls_certificate_for_another_name_is_rejected(ca: trustme.CA) -> None:
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    with Receiver(tls=_tls_server(ca, "other.test", [])) as rx:
        with pytest.raises(NetworkError):
            ssrf.send(
                f"https://hooks.test:{rx.port}/hook",
                b"{}",
                {},
                LOOPBACK_OK,
                resolve=fake_resolver(),
                ssl_context=client_ctx,
            )
        assert rx.received == []


def test_redirects_are_not_followed() -> None:
    with Receiver() as target, Receiver([Answer(302, {"Location": target.url})]) as rx:
        reply = ssrf.send(rx.url, b"{}", {}, LOOPBACK_OK)
        time.sleep(0.1)
        assert reply.status == 302
        assert target.connections == 0
    assert classify(reply.status, None, time.time()).verdict == "fail"


def test_an_oversize_response_is_cut_at_the_cap() -> None:
    huge = Answer(200, body=b"x" * (8 * 1024 * 1024))
    with Receiver([huge]) as rx:
        started = time.monotonic()
        reply = ssrf.send(rx.url, b"{}", {}, LOOPBACK_OK, max_response_bytes=1024)
        elapsed = time.monotonic() - started
    assert reply.status == 200
    assert reply.truncated and len(reply.body) == 1024
    assert elapsed < 2.0


def test_a_slow_receiver_hits_the_read_timeout() -> None:
    with Receiver([Answer(hang_s=10)]) as rx:
        started = time.monotonic()
        with pytest.raises(NetworkError, match="timed out"):
            ssrf.send(rx.url, b"{}", {}, LOOPBACK_OK, read_timeout=0.3)
        assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("body_only", [False, True], ids=["drips-status-line", "drips-body"])
def test_an_endpoint_dripping_bytes_is_cut_off_at_the_attempt_timeout(body_only: bool) -> None:
    # Given an endpoint that sends its answer a byte every 50 ms: each read is far under the
    # read timeout, but the whole answer would take about 30 s
    drip = Answer(body=b"x" * 600, drip_s=0.05, drip_body_only=body_only)
    with Receiver([drip]) as rx:
        # When the attempt may take 0.5 s in all
        with pytest.raises(AttemptTimeout, match="attempt timed out"):
            ssrf.send(rx.url, b"{}", {}, LOOPBACK_OK, read_timeout=5.0, attempt_timeout=0.5)
        # Then the endpoint sees its connection closed long before it has sent everything
        assert rx.cut_off.wait(20)


def test_a_tls_handshake_that_never_ends_is_cut_off_at_the_attempt_timeout() -> None:
    # Given a port whose TCP connections the kernel accepts but nobody ever answers
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"https://127.0.0.1:{silent.getsockname()[1]}/hook"
        # Then the attempt ends at its own deadline, not after the longer connect timeout
        with pytest.raises(AttemptTimeout, match="attempt timed out"):
            ssrf.send(url, b"{}", {}, LOOPBACK_OK, connect_timeout=30, attempt_timeout=0.5)


def test_nothing_listening_is_a_network_error() -> None:
    from batchfleet.redis_server import free_port

    with pytest.raises(NetworkError):
        ssrf.send(f"http://127.0.0.1:{free_port()}/", b"{}", {}, LOOPBACK_OK, connect_timeout=1)
