"""Where and how the gateway listens: TCP or a Unix socket (vLLM's ``--uds``), plain or TLS
(``--ssl-*``, the certificate reloaded when its files change: ``--enable-ssl-refresh``),
and under a root path (``--root-path``, behind a proxy).

vLLM hands these to uvicorn; here they make the same :class:`ssl.SSLContext` uvicorn
makes and a tornado ``HTTPServer`` on the socket it names.
"""

from __future__ import annotations

import logging
import os
import ssl
import stat
import tempfile
from dataclasses import dataclass
from typing import Any

import tornado.httpserver
import tornado.httputil
import tornado.ioloop
import tornado.netutil
import tornado.web

logger = logging.getLogger(__name__)

REFRESH_S = 5.0
"""How often ``--enable-ssl-refresh`` looks at the certificate files."""
UDS_MODE = 0o666
"""The Unix socket's mode (uvicorn's): who may connect is the directory's to say."""


@dataclass(frozen=True, slots=True)
class Tls:
    """vLLM's (uvicorn's) TLS options: the certificate chain and its key, the CAs a client
    certificate is checked against and whether one is asked (``cert_reqs``: an
    ``ssl.CERT_*``, 0 none, 1 optional, 2 required), the cipher list (OpenSSL's syntax),
    and whether the files are read again when they change."""

    certfile: str
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = ssl.CERT_NONE
    ciphers: str | None = None
    refresh: bool = False

    def context(self) -> ssl.SSLContext:
        """The server's TLS context (as uvicorn's ``create_ssl_context``); a file that
        cannot be read or a bad cipher list raise ``OSError`` or ``ssl.SSLError``."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.certfile, self.keyfile)
        ctx.verify_mode = ssl.VerifyMode(self.cert_reqs)
        if self.ca_certs:
            ctx.load_verify_locations(self.ca_certs)
        if self.ciphers:
            ctx.set_ciphers(self.ciphers)
        return ctx


def _stamp(path: str) -> tuple[float, int, int] | None:
    """What tells a file changed (replaced, rewritten): its mtime, size and inode."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime, st.st_size, st.st_ino)


class CertRefresher:
    """Reads ``tls``'s files into ``ctx`` again when they change (vLLM's
    ``SSLCertRefresher``, by polling their stat): new connections get the new
    certificate, open ones keep theirs. A rotation caught half done (a new certificate, the
    old key) fails to load: the old ones stay served, and the next check tries again."""

    def __init__(self, ctx: ssl.SSLContext, tls: Tls) -> None:
        self.ctx = ctx
        self.tls = tls
        self._chain = [p for p in (tls.certfile, tls.keyfile) if p]
        self._seen = self._stamps()
        self._timer: tornado.ioloop.PeriodicCallback | None = None

    def _stamps(self) -> dict[str, tuple[float, int, int] | None]:
        return {p: _stamp(p) for p in [*self._chain, *filter(None, [self.tls.ca_certs])]}

    def check(self) -> bool:
        """Reload what changed since the last check that loaded it (True: reloaded)."""
        now = self._stamps()
        changed = {p for p in now if now[p] != self._seen.get(p)}
        if not changed:
            return False
        try:
            if changed & set(self._chain):
                self._load_chain()
                logger.info("reloaded the TLS certificate chain %s", self.tls.certfile)
            if self.tls.ca_certs in changed:
                # adds the file's CAs (OpenSSL cannot drop those loaded), as vLLM's does
                self.ctx.load_verify_locations(self.tls.ca_certs)
                logger.info("reloaded the TLS CA certificates %s", self.tls.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            logger.error("TLS files changed but do not load (%s): still serving the old", exc)
            return False
        self._seen = now
        return True

    def _load_chain(self) -> None:
        """Load the chain and key as read once, into a scratch context first: a failed load
        into the served context would leave it half changed (a certificate without its
        key), refusing every handshake."""
        with tempfile.TemporaryDirectory(prefix="bf-tls-") as tmp:  # mode 0700
            copies = []
            for i, path in enumerate(self._chain):
                copy = os.path.join(tmp, str(i))
                with open(path, "rb") as src, open(copy, "wb") as dst:
                    dst.write(src.read())
                copies.append(copy)
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(*copies)
            self.ctx.load_cert_chain(*copies)

    def start(self, every_s: float = REFRESH_S) -> None:
        self._timer = tornado.ioloop.PeriodicCallback(self._tick, every_s * 1000)
        self._timer.start()

    def _tick(self) -> None:
        self.check()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.stop()


class Rooted(tornado.web.Application):
    """The app served behind a proxy at ``root_path`` (FastAPI's ``root_path``, as vLLM
    passes it): a path under the prefix is routed without it, any other as it is (the
    proxy may have stripped it), as Starlette routes."""

    def __init__(self, *args: Any, root_path: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root_path = root_path.rstrip("/")

    def find_handler(
        self, request: tornado.httputil.HTTPServerRequest, **kwargs: Any
    ) -> tornado.web._HandlerDelegate:
        root = self.root_path
        if root and request.path.startswith(root):
            rest = request.path[len(root) :]
            if not rest or rest.startswith("/"):
                request.path = rest or "/"
        return super().find_handler(request, **kwargs)


def root_path(value: str) -> str:
    """A ``--root-path``: empty, or starting with ``/`` (no trailing one)."""
    if value and not value.startswith("/"):
        raise ValueError(f"--root-path must start with '/': {value!r}")
    return value.rstrip("/")


@dataclass(slots=True)
class Listening:
    """A started server: stop it with :meth:`close` (which removes its Unix socket)."""

    server: tornado.httpserver.HTTPServer
    address: str
    """Where, for the log: ``https://host:port`` or ``unix:/path (https)``."""
    uds: str | None = None
    refresher: CertRefresher | None = None

    def stop_accepting(self) -> None:
        self.server.stop()

    def close(self) -> None:
        self.server.stop()
        if self.refresher is not None:
            self.refresher.stop()
        if self.uds is not None:
            try:
                if stat.S_ISSOCK(os.stat(self.uds).st_mode):
                    os.remove(self.uds)
            except OSError:
                pass


def listen(
    app: tornado.web.Application,
    *,
    host: str,
    port: int,
    uds: str | None = None,
    tls: Tls | None = None,
    **settings: Any,
) -> Listening:
    """Serve ``app`` on ``uds`` (a Unix socket, replacing a stale one) or ``host:port``,
    over TLS where ``tls`` says; ``settings`` are the ``HTTPServer``'s."""
    ctx = tls.context() if tls is not None else None
    server = tornado.httpserver.HTTPServer(app, ssl_options=ctx, **settings)
    scheme = "https" if ctx is not None else "http"
    if uds is not None:
        server.add_socket(tornado.netutil.bind_unix_socket(uds, mode=UDS_MODE))
        address = f"unix:{uds} ({scheme})"
    else:
        server.listen(port, host)
        address = f"{scheme}://{host}:{port}"
    refresher = None
    if ctx is not None and tls is not None and tls.refresh:
        refresher = CertRefresher(ctx, tls)
        refresher.start()
    return Listening(server, address, uds, refresher)
