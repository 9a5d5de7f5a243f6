"""Cross-origin requests (CORS): which browser pages may call the gateway.

vLLM's ``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers`` and
``--allow-credentials`` configure Starlette's ``CORSMiddleware``; :class:`Cors` answers as
it does (a preflight ``OPTIONS`` is answered before routing and without the API key,
a simple request's answer gets ``Access-Control-Allow-Origin``), so a browser front-end
that works against vLLM works here. Pure: headers in, headers out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
"""What ``"*"`` in the methods stands for (Starlette's)."""
SAFELISTED_HEADERS = frozenset({"Accept", "Accept-Language", "Content-Language", "Content-Type"})
"""Request headers always allowed (CORS-safelisted)."""
MAX_AGE_S = 600
"""How long a browser may keep a preflight's answer (Starlette's default)."""


def json_list(text: str) -> tuple[str, ...]:
    """A flag's value: a JSON list of strings, as vLLM's ``--allowed-origins`` takes."""
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"not a JSON list: {text!r} (e.g. '[\"https://app.example\"]')") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not a JSON list of strings: {text!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class Preflight:
    """The answer to a preflight request: its status, headers and text body."""

    status: int
    headers: dict[str, str]
    text: str


@dataclass(frozen=True, slots=True)
class Cors:
    """The CORS policy: the origins, methods and request headers allowed (``"*"``: any),
    and whether credentials (cookies, ``Authorization``) may be sent."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    @property
    def _all_origins(self) -> bool:
        return "*" in self.origins

    @property
    def _methods(self) -> tuple[str, ...]:
        return ALL_METHODS if "*" in self.methods else self.methods

    def allows(self, origin: str) -> bool:
        return self._all_origins or origin in self.origins

    def preflight(self, origin: str, method: str, requested: str | None) -> Preflight:
        """The answer to ``OPTIONS`` with ``Origin: origin``, ``Access-Control-Request-Method:
        method`` and ``Access-Control-Request-Headers: requested``: 200, or 400 naming what
        is not allowed (the browser then refuses the request)."""
        explicit = not self._all_origins or self.credentials
        headers = {"Vary": "Origin"} if explicit else {"Access-Control-Allow-Origin": "*"}
        headers |= {"Access-Control-Allow-Methods": ", ".join(self._methods),
                    "Access-Control-Max-Age": str(MAX_AGE_S)}  # fmt: skip
        allowed_headers = sorted(SAFELISTED_HEADERS | set(self.headers))
        any_header = "*" in self.headers
        if not any_header:
            headers["Access-Control-Allow-Headers"] = ", ".join(allowed_headers)
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        failures = []
        if not self.allows(origin):
            failures.append("origin")
        elif explicit:
            headers["Access-Control-Allow-Origin"] = origin
        if method not in self._methods:
            failures.append("method")
        if any_header and requested is not None:
            headers["Access-Control-Allow-Headers"] = requested  # echoed: "*" is no wildcard
        elif requested is not None:  # with credentials
            lowered = {h.lower() for h in allowed_headers}
            if any(h.strip().lower() not in lowered for h in requested.split(",")):
                failures.append("headers")
        if failures:
            return Preflight(400, headers, "Disallowed CORS " + ", ".join(failures))
        return Preflight(200, headers, "OK")

    def simple(self, origin: str, request: Mapping[str, str]) -> dict[str, str]:
        """The headers of the answer to any other request from ``origin`` (``request``: its
        headers, for ``Cookie`` and ``Authorization``)."""
        headers = {"Access-Control-Allow-Origin": "*"} if self._all_origins else {}
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        if self._all_origins:
            # "*" is refused by browsers for a request that carries credentials
            echo = (self.credentials and "Authorization" in request) or "Cookie" in request
        else:
            echo = self.allows(origin)
        if echo:
            headers |= {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        return headers
