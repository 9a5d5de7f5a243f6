"""vLLM's flags of how its server is served (TLS, CORS, root path, Unix socket) and of
its answers' frontend switches (``--response-role``, ``--fingerprint-*``, usage, tools,
metrics, ``/tokenizer_info``) as the gateway's flags of the same names
(:mod:`.gateway_flags`), checked as the gateway checks them, so the command written
starts."""

from __future__ import annotations

from collections.abc import Callable

from .producer.gateway.cors import json_list
from .producer.gateway.serving import root_path
from .vllm_args import Flag
from .vllm_conversion import Conversion

TLS_FLAGS = ("--ssl-keyfile", "--ssl-ca-certs", "--ssl-cert-reqs", "--ssl-ciphers",
             "--enable-ssl-refresh")  # fmt: skip
"""What takes effect only with ``--ssl-certfile`` (vLLM's TLS is off without it)."""
CORS_FLAGS = ("--allowed-methods", "--allowed-headers", "--allow-credentials")
"""What the gateway takes only with ``--allowed-origins`` (vLLM's default: ``["*"]``)."""
ANY_ORIGIN = '["*"]'


def _value(flag: Flag, out: Conversion) -> None:
    out.gateway.append((flag.name, flag.value))


def _json_list(flag: Flag, out: Conversion) -> None:
    json_list(flag.value)
    out.gateway.append((flag.name, flag.value))


def _cert_reqs(flag: Flag, out: Conversion) -> None:
    if flag.value not in ("0", "1", "2"):
        raise ValueError("an ssl.CERT_* value: 0 (none), 1 (optional) or 2 (required)")
    out.gateway.append((flag.name, flag.value))


def _root_path(flag: Flag, out: Conversion) -> None:
    if root_path(flag.value):  # "" or "/": the root, as without the flag
        out.gateway.append((flag.name, flag.value))


def _switch(flag: Flag, out: Conversion) -> None:
    out.gateway.append((flag.name,))


def _response_role(flag: Flag, out: Conversion) -> None:
    if not flag.value:
        raise ValueError("the role must not be empty")
    if flag.value == "assistant":
        out.judged(flag, True, "answers' role is assistant, the gateway's default")
    else:
        out.gateway.append((flag.name, flag.value))


def _fingerprint_mode(flag: Flag, out: Conversion) -> None:
    """``full`` is vLLM's default and the gateway's (its workers' version, the gateway's
    ``--data-parallel-size`` as ``dp`` and their serving hash in place of vLLM's); ``hash``,
    ``custom`` and ``none`` are the gateway's flag of the same value."""
    if flag.value == "full":
        out.judged(flag, True, "the gateway's default: batchfleet-VERSION[-dpN]-HASH8 of "
                   "the model's workers (their serving hash in place of vLLM's config's)")  # fmt: skip
    elif flag.value in ("hash", "custom", "none"):
        out.gateway.append((flag.name, flag.value))
    else:
        raise ValueError("full, hash, custom or none")


SERVING: dict[str, Callable[[Flag, Conversion], None]] = {
    "--ssl-certfile": _value, "--ssl-keyfile": _value, "--ssl-ca-certs": _value,
    "--ssl-ciphers": _value, "--ssl-cert-reqs": _cert_reqs, "--enable-ssl-refresh": _switch,
    "--allowed-origins": _json_list, "--allowed-methods": _json_list,
    "--allowed-headers": _json_list, "--allow-credentials": _switch,
    "--root-path": _root_path, "--uds": _value, "--response-role": _response_role,
    "--fingerprint-mode": _fingerprint_mode, "--fingerprint-value": _value,
    **dict.fromkeys(("--enable-force-include-usage", "--exclude-tools-when-tool-choice-none",
                     "--enable-per-request-metrics", "--enable-tokenizer-info-endpoint"),
                    _switch),
}  # fmt: skip
"""vLLM's serving and answer flags and how each becomes the gateway's."""


def serving_defaults(out: Conversion) -> None:
    """What vLLM's defaults say of the flags given: CORS flags without
    ``--allowed-origins`` apply to any origin (vLLM's default; the gateway's is none), TLS
    flags without ``--ssl-certfile`` to nothing (plain HTTP), ``--fingerprint-value``
    without ``--fingerprint-mode custom`` to nothing (a ``ValueError``: custom without a
    value)."""
    given = {args[0] for args in out.gateway}
    custom = ("--fingerprint-mode", "custom") in out.gateway
    if "--fingerprint-value" in given and not custom:
        value = next(a for a in out.gateway if a[0] == "--fingerprint-value")
        out.gateway.remove(value)
        out.needless.append(f"{' '.join(value)}: read with --fingerprint-mode custom only "
                            "(as vLLM reads it)")  # fmt: skip
    elif custom and "--fingerprint-value" not in given:
        raise ValueError("--fingerprint-mode custom needs --fingerprint-value")
    if given & set(CORS_FLAGS) and "--allowed-origins" not in given:
        at = min(i for i, args in enumerate(out.gateway) if args[0] in CORS_FLAGS)
        out.gateway.insert(at, ("--allowed-origins", ANY_ORIGIN))
    if "--ssl-certfile" not in given:
        for args in [a for a in out.gateway if a[0] in TLS_FLAGS]:
            out.gateway.remove(args)
            out.needless.append(f"{' '.join(args)}: no --ssl-certfile, so plain HTTP "
                                "(as vLLM serves)")  # fmt: skip
