"""`batchfleet gateway`'s flags for how it is served (TLS, CORS, root path, Unix socket)
and how it answers (vLLM's frontend switches: :mod:`.producer.gateway.frontend`).

vLLM's names (``--ssl-keyfile`` ..., ``--allowed-origins`` ..., ``--root-path``,
``--uds``, ``--response-role`` ...), each defaulting to its ``BATCHFLEET_*`` environment variable (the flag's name
in capitals, ``-`` as ``_``), so `batchfleet from-vllm`'s gateway command takes vLLM's
flags as they are. Imports nothing heavy: the CLI stays light.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .producer.gateway.cors import Cors
    from .producer.gateway.frontend import Frontend
    from .producer.gateway.serving import Tls

TRUE = frozenset({"1", "true", "yes", "on"})
CORS_FLAGS = ("allowed_methods", "allowed_headers", "allow_credentials")
FINGERPRINT_MODES = ("full", "hash", "custom", "none")
"""vLLM's ``--fingerprint-mode`` values (:mod:`.producer.gateway.fingerprint`)."""


def _env(flag: str) -> str | None:
    return os.environ.get("BATCHFLEET_" + flag.lstrip("-").replace("-", "_").upper()) or None


def _switch(group: Any, flag: str, help: str) -> None:
    """An off-by-default switch whose default is its environment variable's (``1``,
    ``true``, ``yes``, ``on``: on)."""
    group.add_argument(flag, action="store_true", default=(_env(flag) or "").lower() in TRUE,
                       help=help)  # fmt: skip


def add_serving_flags(gw: argparse.ArgumentParser) -> None:
    """The flags, on the gateway command's parser."""
    tls = gw.add_argument_group("TLS (vLLM's --ssl-*; default $BATCHFLEET_<FLAG>)")
    tls.add_argument("--ssl-certfile", default=_env("--ssl-certfile"),
                     help="serve HTTPS with this certificate chain (PEM)")  # fmt: skip
    tls.add_argument("--ssl-keyfile", default=_env("--ssl-keyfile"),
                     help="its private key (PEM; default: in the certificate file)")  # fmt: skip
    tls.add_argument("--ssl-ca-certs", default=_env("--ssl-ca-certs"),
                     help="CA certificates a client certificate is checked against")  # fmt: skip
    tls.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2),
                     default=_env("--ssl-cert-reqs") or "0",
                     help="ask clients for a certificate, as Python's ssl.CERT_*: 0 no, 1 "
                     "optional, 2 required (mutual TLS)")  # fmt: skip
    tls.add_argument("--ssl-ciphers", default=_env("--ssl-ciphers"),
                     help="the ciphers allowed (OpenSSL's cipher list syntax)")  # fmt: skip
    _switch(
        tls,
        "--enable-ssl-refresh",
        "read the certificate, key and CA files again when "
        "they change (new connections get the new certificate)",
    )
    cors = gw.add_argument_group("CORS (vLLM's; default $BATCHFLEET_<FLAG>)")
    cors.add_argument("--allowed-origins", default=_env("--allowed-origins"),
                      help="JSON list of the origins whose pages may call the gateway, e.g. "
                      "'[\"https://app.example\"]' ('[\"*\"]': any, vLLM's default; default "
                      "here: none, no CORS headers)")  # fmt: skip
    cors.add_argument("--allowed-methods", default=_env("--allowed-methods"),
                      help="JSON list of the methods allowed (default '[\"*\"]')")  # fmt: skip
    cors.add_argument("--allowed-headers", default=_env("--allowed-headers"),
                      help="JSON list of the request headers allowed (default '[\"*\"]')")  # fmt: skip
    _switch(cors, "--allow-credentials", "allow cookies and Authorization on cross-origin requests")
    gw.add_argument("--root-path", default=_env("--root-path") or "",
                    help="the path prefix a proxy serves the gateway under (e.g. /llm): "
                    "paths are routed with it or without it (default $BATCHFLEET_ROOT_PATH)")  # fmt: skip
    gw.add_argument("--uds", default=_env("--uds"),
                    help="listen on this Unix socket instead of --host and --port (default "
                    "$BATCHFLEET_UDS)")  # fmt: skip
    _add_frontend_flags(gw)


def _add_frontend_flags(gw: argparse.ArgumentParser) -> None:
    answers = gw.add_argument_group("answers (vLLM's frontend flags; default $BATCHFLEET_<FLAG>)")
    answers.add_argument("--response-role", default=_env("--response-role") or "assistant",
                         help="a chat answer's role where the request adds the generation "
                         "prompt (default assistant)")  # fmt: skip
    answers.add_argument("--fingerprint-mode", choices=FINGERPRINT_MODES,
                         default=_env("--fingerprint-mode") or "full",
                         help="whole answers' system_fingerprint: full (default: "
                         "batchfleet-VERSION[-dpN]-HASH8 of the model's workers), hash "
                         "(without dpN), custom (--fingerprint-value) or none (null)")  # fmt: skip
    answers.add_argument("--data-parallel-size", type=int,
                         default=_env("--data-parallel-size") or 1, metavar="N",
                         help="the replicas (workers a model) the fleet is deployed with, "
                         "as vLLM's: full fingerprints name it as dpN where N > 1 (default "
                         "1); fixed, so they stay as workers come and go")  # fmt: skip
    answers.add_argument("--fingerprint-value", default=_env("--fingerprint-value"),
                         help="the system_fingerprint of --fingerprint-mode custom")  # fmt: skip
    _switch(
        answers,
        "--enable-force-include-usage",
        "every stream ends with its usage, as if stream_options.include_usage were set",
    )
    _switch(
        answers,
        "--exclude-tools-when-tool-choice-none",
        "a request whose tool_choice is none reaches the chat template without its tools",
    )
    _switch(
        answers,
        "--enable-per-request-metrics",
        "one-output chat and completion answers "
        "carry vLLM's per-request timing metrics (streamed: in the usage chunk)",
    )
    _switch(
        answers,
        "--enable-tokenizer-info-endpoint",
        "serve GET /tokenizer_info (the model's tokenizer configuration and chat template)",
    )


def serving_options(args: argparse.Namespace) -> dict[str, Any]:
    """``serve``'s ``tls``, ``cors``, ``root_path``, ``uds`` and ``frontend`` of the parsed
    flags; a ``ValueError`` says what is wrong with them."""
    from .producer.gateway.serving import root_path

    return {"tls": _tls(args), "cors": _cors(args), "root_path": root_path(args.root_path),
            "uds": args.uds, "frontend": _frontend(args)}  # fmt: skip


def _frontend(args: argparse.Namespace) -> Frontend:
    from .producer.gateway.frontend import Frontend

    if not args.response_role:
        raise ValueError("--response-role must not be empty")
    if args.fingerprint_mode not in FINGERPRINT_MODES:  # from the environment
        raise ValueError(f"--fingerprint-mode must be one of {', '.join(FINGERPRINT_MODES)}, "
                         f"not {args.fingerprint_mode}")  # fmt: skip
    dp = args.data_parallel_size  # (argparse's int of its environment variable too)
    if dp < 1:
        raise ValueError(f"--data-parallel-size must be a whole number >= 1, not {dp}")
    custom = args.fingerprint_mode == "custom"
    if custom != bool(args.fingerprint_value):
        raise ValueError("--fingerprint-mode custom needs --fingerprint-value" if custom else
                         "--fingerprint-value given without --fingerprint-mode custom")  # fmt: skip
    return Frontend(args.response_role, args.fingerprint_value,
                    args.enable_force_include_usage, args.exclude_tools_when_tool_choice_none,
                    args.enable_per_request_metrics, args.enable_tokenizer_info_endpoint,
                    args.fingerprint_mode, dp)  # fmt: skip


def _tls(args: argparse.Namespace) -> Tls | None:
    from .producer.gateway.serving import Tls

    if args.ssl_certfile is None:
        given = [f"--{n.replace('_', '-')}" for n in ("ssl_keyfile", "ssl_ca_certs",
                 "ssl_ciphers", "enable_ssl_refresh") if getattr(args, n)]  # fmt: skip
        if given or args.ssl_cert_reqs:
            raise ValueError(f"{', '.join(given) or '--ssl-cert-reqs'} given without "
                             "--ssl-certfile (TLS needs the certificate)")  # fmt: skip
        return None
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, not {args.ssl_cert_reqs}")
    return Tls(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs,
               args.ssl_ciphers, args.enable_ssl_refresh)  # fmt: skip


def _cors(args: argparse.Namespace) -> Cors | None:
    from .producer.gateway.cors import Cors, json_list

    if args.allowed_origins is None:
        given = [f"--{n.replace('_', '-')}" for n in CORS_FLAGS if getattr(args, n)]
        if given:
            raise ValueError(f"{', '.join(given)} given without --allowed-origins (the "
                             "gateway allows no cross-origin request by default)")  # fmt: skip
        return None
    return Cors(json_list(args.allowed_origins),
                json_list(args.allowed_methods) if args.allowed_methods else ("*",),
                json_list(args.allowed_headers) if args.allowed_headers else ("*",),
                args.allow_credentials)  # fmt: skip
