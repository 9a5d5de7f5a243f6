"""SSRF-safe HTTP POST to a client-supplied URL.

Webhook URLs come from clients, so a URL must not reach the fleet's own network: the host is
resolved **once**, every address it resolves to is checked, and the connection goes to that
pinned address (no second lookup, so no DNS rebinding), with TLS SNI and certificate checks
against the URL's hostname. No redirects, a cap on the response read, and timeouts: per
connect and per read, and one for the whole attempt, which a watchdog enforces by shutting
the socket down (a read timeout alone lets a server that drips a byte now and then hold an
attempt forever).

``requests-hardened`` does the pinning the same way but has no operator allowlist of hosts or
CIDRs and no response cap, and checks only the first address: hence this module, on urllib3.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import HTTPError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from .errors import AttemptTimeout, NetworkError, TargetRefused

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]
"""``(host, port) -> addresses``; injected by tests."""

METADATA = {
    ipaddress.ip_address("169.254.169.254"): "cloud metadata",  # AWS, GCP, Azure, OpenStack
    ipaddress.ip_address("169.254.170.2"): "cloud metadata",  # AWS ECS task metadata
    ipaddress.ip_address("100.100.100.200"): "cloud metadata",  # Alibaba
    ipaddress.ip_address("fd00:ec2::254"): "cloud metadata",  # AWS IPv6
}
BLOCKED_NETS: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), why)
    for net, why in [
        ("100.64.0.0/10", "carrier-grade NAT"),
        ("192.88.99.0/24", "6to4 relay"),
        ("64:ff9b::/96", "NAT64 (embeds an IPv4 address)"),
        ("64:ff9b:1::/48", "NAT64 (embeds an IPv4 address)"),
        ("2002::/16", "6to4 (embeds an IPv4 address)"),
    ]
)


def refusal(ip: IPAddress) -> str | None:
    """Why a connection to ``ip`` is refused, or None if it is a public unicast address."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        inner = refusal(ip.ipv4_mapped)
        return None if inner is None else f"IPv4-mapped {inner}"
    if ip in METADATA:
        return METADATA[ip]
    for net, why in BLOCKED_NETS:
        if ip in net:
            return why
    for test, why in [
        (ip.is_loopback, "loopback"),
        (ip.is_link_local, "link-local"),
        (ip.is_multicast, "multicast"),
        (ip.is_unspecified, "unspecified"),
        (ip.is_private, "private"),
        (ip.is_reserved, "reserved"),
        (not ip.is_global, "not globally routable"),
    ]:
        if test:
            return why
    return None


@dataclass(frozen=True)
class Policy:
    """Which webhook targets are allowed: https only and public addresses, unless allowed."""

    allow_http: bool = False
    allow_hosts: frozenset[str] = frozenset()
    allow_nets: tuple[IPNetwork, ...] = ()

    @classmethod
    def build(cls, allow: Iterable[str] = (), *, allow_http: bool = False) -> Policy:
        """From the fleet file's ``allow`` list: CIDRs (``10.0.0.0/8``), IPs and host names."""
        hosts: set[str] = set()
        nets: list[IPNetwork] = []
        for item in allow:
            try:
                nets.append(ipaddress.ip_network(item.strip("[]"), strict=False))
            except ValueError:
                hosts.add(item.lower().rstrip("."))
        return cls(allow_http, frozenset(hosts), tuple(nets))

    def allows(self, host: str, ip: IPAddress) -> bool:
        return host in self.allow_hosts or any(ip in net for net in self.allow_nets)


@dataclass(frozen=True)
class Target:
    """A checked URL: connect to ``ip`` only, present ``host`` (Host header, SNI, cert)."""

    scheme: str
    host: str
    port: int
    path: str
    ip: IPAddress

    @property
    def host_header(self) -> str:
        name = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return name if self.port == default else f"{name}:{self.port}"


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)]


def check_url(url: str, policy: Policy, resolve: Resolver = system_resolver) -> Target:
    """Resolve ``url``'s host once and return the pinned target; raise :class:`TargetRefused`."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme != "https" and not (scheme == "http" and policy.allow_http):
        raise TargetRefused(f"scheme {scheme!r} not allowed (https only)")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("credentials in the URL are not allowed")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise TargetRefused("URL has no host")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise TargetRefused("bad port") from None
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [literal]
    else:
        try:
            found = resolve(host, port)
        except (OSError, UnicodeError) as exc:
            raise NetworkError(f"cannot resolve {host}: {exc}") from None
        addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in found]
        if not addresses:
            raise NetworkError(f"{host} resolves to no address")
    for ip in addresses:  # every address must pass: a mixed answer is refused
        why = refusal(ip)
        if why is not None and not policy.allows(host, ip):
            raise TargetRefused(f"{host} resolves to {ip} ({why}); not in the webhooks allowlist")
    return Target(scheme, host, port, path, addresses[0])


@dataclass(frozen=True)
class Reply:
    """What came back: status, headers (lower-case names), and at most the capped body."""

    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    truncated: bool = False


class Deadline:
    """Shuts an attempt's socket down once ``seconds`` have passed, which ends any connect,
    TLS handshake, write or read in progress on it: the whole attempt is bounded."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _Watched:
    """A urllib3 connection whose socket is handed to a :class:`Deadline` once created."""

    def __init__(self, *args: Any, deadline: Deadline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def _new_conn(self) -> socket.socket:
        sock: socket.socket = super()._new_conn()  # type: ignore[misc]
        self._deadline.watch(sock)
        return sock


class _WatchedHTTP(_Watched, HTTPConnection):
    pass


class _WatchedHTTPS(_Watched, HTTPSConnection):
    pass


class _HTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _WatchedHTTP


class _HTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPS


def post(
    target: Target,
    body: bytes,
    headers: Mapping[str, str],
    *,
    connect_timeout: float = 5.0,
    read_timeout: float = 10.0,
    attempt_timeout: float = 15.0,
    max_response_bytes: int = 64 * 1024,
    ssl_context: ssl.SSLContext | None = None,
) -> Reply:
    """POST ``body`` to the pinned ``target``; redirects are returned, never followed.

    Raises :class:`AttemptTimeout` when a connect or a read takes longer than its timeout,
    or the whole attempt (connect, send, and the complete response) longer than
    ``attempt_timeout``; :class:`NetworkError` for other failures.
    """
    deadline = Deadline(attempt_timeout)
    # The socket exists only once connected, so the deadline cannot cut a connect short
    timeout = urllib3.Timeout(connect=min(connect_timeout, attempt_timeout), read=read_timeout)
    common: dict[str, Any] = {"timeout": timeout, "retries": False, "maxsize": 1}
    pool: urllib3.HTTPConnectionPool
    if target.scheme == "https":
        named = _is_name(target.host)
        pool = _HTTPSPool(
            str(target.ip),
            target.port,
            ssl_context=ssl_context,
            cert_reqs="CERT_REQUIRED",
            server_hostname=target.host if named else None,
            assert_hostname=target.host,
            deadline=deadline,
            **common,
        )
    else:
        pool = _HTTPPool(str(target.ip), target.port, deadline=deadline, **common)
    sent = {"Host": target.host_header, "Connection": "close", **headers}
    try:
        with deadline, pool:
            response = pool.urlopen(
                "POST",
                target.path,
                body=body,
                headers=sent,
                redirect=False,
                retries=False,
                preload_content=False,
                decode_content=False,
                assert_same_host=False,
            )
            try:
                data = response.read(max_response_bytes + 1, decode_content=False)
            finally:
                response.close()
    except (HTTPError, OSError) as exc:
        if deadline.expired:
            raise _overran(deadline) from None
        if isinstance(exc, Urllib3Timeout | TimeoutError):
            raise AttemptTimeout(f"timed out: {exc}") from None
        raise NetworkError(f"{type(exc).__name__}: {exc}") from None
    if deadline.expired:  # cut off mid-response, or finished just as time ran out
        raise _overran(deadline)
    found = {k.lower(): v for k, v in response.headers.items()}
    return Reply(response.status, found, data[:max_response_bytes], len(data) > max_response_bytes)


def _overran(deadline: Deadline) -> AttemptTimeout:
    return AttemptTimeout(f"attempt timed out: no complete response within {deadline.seconds:g}s")


def send(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    policy: Policy,
    *,
    resolve: Resolver = system_resolver,
    connect_timeout: float = 5.0,
    read_timeout: float = 10.0,
    attempt_timeout: float = 15.0,
    max_response_bytes: int = 64 * 1024,
    ssl_context: ssl.SSLContext | None = None,
) -> Reply:
    """Check ``url`` against ``policy`` (one DNS lookup), then POST to the pinned address."""
    return post(
        check_url(url, policy, resolve),
        body,
        headers,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        attempt_timeout=attempt_timeout,
        max_response_bytes=max_response_bytes,
        ssl_context=ssl_context,
    )


def _is_name(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False
