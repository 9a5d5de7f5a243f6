"""``batchfleet from-vllm`` maps vLLM's TLS, CORS, ``--root-path`` and ``--uds`` flags to
the gateway's, refuses values the gateway would not start with, and follows vLLM's
defaults where a flag leans on another (CORS flags without origins: any origin)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from vllm_commands import run

from batchfleet import cli
from batchfleet.gateway_flags import serving_options


def gateway_args(tmp_path: Path, flags: list[str]) -> tuple[list[str], str]:
    """The gateway command's flags from ``vllm serve /m/x FLAGS``, and the fleet file."""
    code, _, gateway, stderr = run(tmp_path, ["serve", "/m/x", *flags])
    assert code == 0, stderr
    argv = shlex.split(gateway.split("  #")[0])[1:]
    options = serving_options(cli.build_parser().parse_args(argv))  # the gateway takes them
    assert options is not None
    assert argv[:5] == ["gateway", "--config", str(tmp_path / "fleet.toml"), "--host", "0.0.0.0"]
    return argv[5:], (tmp_path / "fleet.toml").read_text()


@pytest.mark.parametrize(("flags", "expect"), [
    (["--ssl-certfile", "/t/c.pem", "--ssl-keyfile", "/t/k.pem", "--ssl-ca-certs", "/t/ca.pem",
      "--ssl-cert-reqs", "2", "--ssl-ciphers", "ECDHE+AESGCM", "--enable-ssl-refresh"],
     ["--ssl-certfile", "/t/c.pem", "--ssl-keyfile", "/t/k.pem", "--ssl-ca-certs", "/t/ca.pem",
      "--ssl-cert-reqs", "2", "--ssl-ciphers", "ECDHE+AESGCM", "--enable-ssl-refresh"]),
    (["--allowed-origins", '["https://a"]', "--allow-credentials"],
     ["--allowed-origins", '["https://a"]', "--allow-credentials"]),
    # vLLM's origins default to any: kept where the other CORS flags lean on it
    (["--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["Authorization"]'],
     ["--allowed-origins", '["*"]', "--allowed-methods", '["GET", "POST"]',
      "--allowed-headers", '["Authorization"]']),
    (["--root-path", "/llm", "--uds", "/run/gw.sock"], ["--root-path", "/llm", "--uds",
                                                        "/run/gw.sock"]),
    (["--root-path", "/", "--no-allow-credentials", "--disable-ssl-refresh"], []),
    # the answers' switches
    (["--response-role", "bot", "--fingerprint-mode", "custom", "--fingerprint-value", "fp-7",
      "--enable-force-include-usage", "--exclude-tools-when-tool-choice-none",
      "--enable-per-request-metrics", "--enable-tokenizer-info-endpoint"],
     ["--response-role", "bot", "--fingerprint-mode", "custom", "--fingerprint-value", "fp-7",
      "--enable-force-include-usage", "--exclude-tools-when-tool-choice-none",
      "--enable-per-request-metrics", "--enable-tokenizer-info-endpoint"]),
    (["--response-role", "assistant", "--fingerprint-mode", "full",
      "--no-enable-force-include-usage", "--disable-tokenizer-info-endpoint",
      "--no-exclude-tools-when-tool-choice-none", "--disable-per-request-metrics"], []),
    (["--fingerprint-mode", "hash"], ["--fingerprint-mode", "hash"]),
    (["--fingerprint-mode", "none"], ["--fingerprint-mode", "none"]),
])  # fmt: skip
def test_serving_flags_become_the_gateways(
    tmp_path: Path, flags: list[str], expect: list[str]
) -> None:
    args, _ = gateway_args(tmp_path, flags)
    assert args == expect


def test_tls_flags_without_a_certificate_are_plain_http_as_vllms(tmp_path: Path) -> None:
    args, text = gateway_args(tmp_path, ["--ssl-keyfile", "/t/k.pem", "--ssl-cert-reqs", "1"])
    assert not [a for a in args if a.startswith("--ssl")]
    assert "--ssl-keyfile /t/k.pem: no --ssl-certfile, so plain HTTP" in text


def test_fingerprints_as_vllm_reads_them(tmp_path: Path) -> None:
    # full is vLLM's default and the gateway's; a value without custom is read by nothing,
    # as vLLM's
    args, text = gateway_args(tmp_path, ["--fingerprint-mode", "full"])
    assert args == [] and "--fingerprint-mode full: the gateway's default" in text
    args, text = gateway_args(tmp_path, ["--response-role", "assistant"])
    assert args == [] and "--response-role assistant: answers' role is assistant" in text
    for flags in (["--fingerprint-value", "fp-7"],
                  ["--fingerprint-mode", "hash", "--fingerprint-value", "fp-7"]):  # fmt: skip
        args, text = gateway_args(tmp_path, flags)
        assert "--fingerprint-value" not in args
        assert "--fingerprint-value fp-7: read with --fingerprint-mode custom" in text


@pytest.mark.parametrize(("flags", "said"), [
    (["--ssl-certfile", "/c", "--ssl-cert-reqs", "3"], "--ssl-cert-reqs 3"),
    (["--fingerprint-mode", "custom"], "needs --fingerprint-value"),
    (["--fingerprint-mode", "sha"], "full, hash, custom or none"),
    (["--response-role", ""], "must not be empty"),
    (["--allowed-origins", "https://a"], "not a JSON list"),
    (["--allowed-headers", '{"a": 1}'], "not a JSON list of strings"),
    (["--root-path", "llm"], "must start with '/'"),
])  # fmt: skip
def test_values_the_gateway_refuses_are_refused(
    tmp_path: Path, flags: list[str], said: str
) -> None:
    code, _, _, stderr = run(tmp_path, ["serve", "/m/x", *flags])
    assert code == 2 and said in stderr, stderr
