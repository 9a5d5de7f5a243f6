"""``batchfleet from-vllm`` knows every flag of ``vllm serve`` (vLLM 0.34.0's parser): each
is a setting, needs nothing, or has no equivalent, with why; the command line is split
as vLLM's parser splits it; the newer mappings reach the fleet file and the runner."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from batchfleet.worker.generation.speculative import NgramConfig, parse
from vllm_commands import run, started_runner

from batchfleet import cli
from batchfleet.vllm_args import VllmArgsError, human_int, read_serve
from batchfleet.vllm_catalog import ARITY, OFF
from batchfleet.vllm_flags import (
    BY_VALUE,
    HANDLERS,
    NEEDLESS,
    UNSUPPORTED,
    judgement,
    simple_options,
)


def test_every_flag_of_vllm_serve_has_a_meaning_here() -> None:
    read_here = {"--model", "--config"}  # the model and the YAML file: read by the reader
    meant = {*simple_options(), *HANDLERS}
    blank = [f for f in ARITY if f not in meant | read_here and judgement(f) is None]
    assert blank == []
    # and no table names a flag vLLM does not take (a typo would hide the real one)
    stale = [f for f in (*NEEDLESS, *UNSUPPORTED, *BY_VALUE, *meant) if f not in ARITY]
    assert stale == []
    assert all(why for why in (*NEEDLESS.values(), *UNSUPPORTED.values()))


PRODUCTION = shlex.split("""
vllm serve /models/Qwen3-30B-A3B --served-model-name qwen3 --host 10.0.0.5 --port 8080
  --api-key sk-prod --uvicorn-log-level warning --disable-uvicorn-access-log
  --disable-log-requests --max-log-len 200 --enable-prompt-tokens-details
  --enable-request-id-headers --enable-server-load-tracking --disable-fastapi-docs
  --dtype bfloat16 --max-model-len 32k --max_num_seqs 256 --max-num-active-seqs 96
  --max-num-batched-tokens 8K --block-size 16 --gpu-memory-utilization 0.92
  --kv-cache-dtype auto --enable-prefix-caching --prefix-caching-hash-algo sha256
  --enable-chunked-prefill --no-async-scheduling -tp 1 -dp 2 --distributed-executor-backend mp
  --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
  --enable-lora --max-loras 4 --max-lora-rank 64 --lora-modules sql=/loras/sql
  --speculative-config.method ngram --spec-tokens 4 --generation-config auto
  --override-generation-config '{"temperature": 0.6}' --trust-remote-code
  --download-dir /cache --load-format safetensors --hf-token -O3
  --cudagraph-capture-sizes 1 2 4 8 --max-num-queued-reqs 512 --shutdown-timeout 20
  --device-ids 1 --otlp-traces-endpoint http://otel:4317 --collect-detailed-traces all
  --limit-mm-per-prompt '{"image": 0}' --tokenizer-mode auto --scheduling-policy priority
  --allowed-origins '["*"]' --ssl-keyfile /tls/key.pem --ssl-certfile /tls/cert.pem
  --enable-log-outputs --no-enable-log-deltas --seed 7 --max-logprobs 20
  --logprobs-mode raw_logprobs --no-trust-request-chat-template --language-model-only
  --enable-expert-parallel --enable-eplb --disable-custom-all-reduce --enforce-eager
""")
"""A serving command line of the kind production runs, across every area of flags."""


def test_a_production_command_line_converts_with_every_flag_accounted_for(
    tmp_path: Path,
) -> None:
    # Given a long command line (underscores, -tp/-dp, -O3, a JSON key given alone, a bare
    # --hf-token, numbers with suffixes), when it is converted
    code, fleet, gateway, stderr = run(tmp_path, PRODUCTION)

    # Then it is written and loads, with nothing unknown
    assert code == 0, stderr
    assert "unknown" not in stderr.lower()
    text = (tmp_path / "fleet.toml").read_text()
    # each flag is cited by a line, listed with why, or in the gateway command
    given = {SHORT_OR_SAME.get(t, t) for t in PRODUCTION if t.startswith("-")}
    given = {t.replace("_", "-").split(".")[0] for t in given}
    cited = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", f"{text} {gateway}"))
    assert sorted(given - cited) == []
    # the settings
    model = fleet["models"]["qwen3"]
    assert (model["dtype"], model["max_tokens"], model["device"]) == ("bfloat16", 31_999, "cuda:1")
    assert model["max_queue_depth"] == 512
    opts = model["options"]
    assert opts["max_running"] == 96  # --max-num-active-seqs over --max-num-seqs
    assert (opts["step_tokens"], opts["page_size"], opts["max_loras"]) == (8192, 16, 4)
    assert opts["schedule_ahead"] is False
    assert opts["speculative"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert opts["lora_adapters"] == {"sql": "/loras/sql"}
    assert fleet["worker"]["shutdown_grace_s"] == 20
    args = cli.build_parser().parse_args(shlex.split(gateway.split("  #")[0])[1:])
    assert (args.host, args.port, args.grace) == ("10.0.0.5", 8080, 20.0)
    # TLS and CORS are the gateway's, as vLLM's
    assert (args.ssl_certfile, args.ssl_keyfile) == ("/tls/cert.pem", "/tls/key.pem")
    assert args.allowed_origins == '["*"]'
    # what has no equivalent is said on stderr
    for flag in (
        "--trust-remote-code",
        "--gpu-memory-utilization 0.92",
        "--otlp-traces-endpoint",
        "--enable-expert-parallel",
        "--limit-mm-per-prompt",
    ):
        assert f"no equivalent: {flag}" in stderr
    assert opts["seed"] == 7
    assert "#   --max-num-seqs 256: --max-num-active-seqs sets max_running over it" in text


SHORT_OR_SAME = {"-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size",
                 "-O3": "--optimization-level"}  # fmt: skip


@pytest.mark.parametrize(("flags", "where", "expect"), [
    (["--max-num-active-seqs", "32", "--max-num-seqs", "256"], "options", {"max_running": 32}),
    (["--no-async-scheduling"], "options", {"schedule_ahead": False}),
    (["--disable-prefix-caching"], "options", {"prefix_cache_tokens": 0}),
    (["--spec-method", "ngram", "--spec-tokens", "3"], "options",
     {"speculative": {"method": "ngram", "num_speculative_tokens": 3}}),
    (["--speculative_config.num-speculative-tokens", "5", "--speculative-config.method",
      "ngram"], "options", {"speculative": {"num_speculative_tokens": 5, "method": "ngram"}}),
    (["--speculative-config", '{"num-speculative-tokens": 2}', "--spec-method", "ngram"],
     "options", {"speculative": {"num_speculative_tokens": 2, "method": "ngram"}}),
    (["--speculative-config.method", "ngram", "--speculative-config.disable-by-batch-size",
      "8", "--spec-tokens", "3"], "options", {"speculative": {
          "method": "ngram", "disable_by_batch_size": 8, "num_speculative_tokens": 3}}),
    (["--block-size", "16", "--num-gpu-blocks-override", "1000"], "options",
     {"kv_cache_tokens": 16_000, "page_size": 16}),
    (["--max-num-batched-tokens", "2k"], "options", {"step_tokens": 2000}),
    (["--kv-cache-dtype", "bfloat16"], "options", {"kv_cache_dtype": "bfloat16"}),
    (["--dtype", "float32", "--kv-cache-dtype", "bfloat16"], "options",
     {"kv_cache_dtype": "bfloat16"}),
    (["--structured-outputs-config", '{"backend": "xgrammar", "reasoning_parser": "qwen3"}'],
     "options", {"reasoning_parser": "qwen3"}),
    (["--max-num-queued-reqs", "100"], "model", {"max_queue_depth": 100}),
    (["--device-ids", "2"], "model", {"device": "cuda:2"}),
    (["--max-model-len", "32K"], "model", {"max_tokens": 32_767}),
    (["--max-model-len", "auto"], "model", {"max_tokens": 65_536}),
    (["--shutdown-timeout", "45"], "worker", {"shutdown_grace_s": 45}),
    (["--seed", "42"], "options", {"seed": 42}),
    ([], "options", {"seed": 0}),  # vLLM's default seed
    (["--chat-template", "/templates/chatml.jinja", "--trust-request-chat-template",
      "--default-chat-template-kwargs", '{"enable_thinking": false}',
      "--chat-template-content-format", "openai"], "options",
     {"chat_template": "/templates/chatml.jinja", "trust_request_chat_template": True,
      "default_chat_template_kwargs": {"enable_thinking": False},
      "chat_template_content_format": "openai"}),
    (["--chat-template", "{{ messages[0]['content'] }}"], "options",
     {"chat_template": "{{ messages[0]['content'] }}"}),
])  # fmt: skip
def test_newer_flags_reach_the_fleet_file(
    tmp_path: Path, flags: list[str], where: str, expect: dict[str, object]
) -> None:
    code, fleet, _, stderr = run(tmp_path, ["serve", "/m/x", *flags])
    assert code == 0, stderr
    got = {"model": fleet["models"]["x"], "options": fleet["models"]["x"].get("options", {}),
           "worker": fleet.get("worker", {})}[where]  # fmt: skip
    for key, value in expect.items():
        assert got[key] == value, key


@pytest.mark.parametrize(("flags", "bounds"), [
    (["--speculative-config.method", "ngram"], (5, 5)),  # neither: vLLM's 5 and 5
    (["--spec-method", "ngram", "--speculative-config.prompt_lookup_max", "3"], (3, 3)),
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_min": 2}'], (2, 2)),
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_min": 2, '
      '"prompt_lookup_max": 4}'], (2, 4)),
])  # fmt: skip
def test_ngram_lookup_bounds_are_vllm_s_when_not_given(
    tmp_path: Path, flags: list[str], bounds: tuple[int, int]
) -> None:
    code, fleet, _, stderr = run(tmp_path, ["serve", "/m/x", "--spec-tokens", "3", *flags])
    assert code == 0, stderr
    spec = parse(fleet["models"]["x"]["options"]["speculative"])
    assert isinstance(spec, NgramConfig)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == bounds


def test_ngram_lookup_min_above_max_is_refused_with_vllm_s_words(tmp_path: Path) -> None:
    spec = '{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}'
    code, _, _, stderr = run(tmp_path, ["serve", "/m/x", "--spec-tokens", "3",
                                        "--speculative-config", spec])  # fmt: skip
    assert code != 0
    assert "prompt_lookup_min=4 must be <= prompt_lookup_max=2" in stderr


@pytest.mark.parametrize(("flags", "needless", "listed"), [
    (["--no-trust-remote-code"], True, "--no-trust-remote-code: --trust-remote-code is off"),
    (["--disable-sleep-mode"], True, "--disable-sleep-mode: --enable-sleep-mode is off, as here"),
    (["--disable-auto-tool-choice"], True, '--disable-auto-tool-choice: tool_choice "auto" is'),
    (["--tokenizer-mode", "auto"], True, "--tokenizer-mode auto: the model directory's"),
    (["--tokenizer-mode", "mistral"], False, "--tokenizer-mode mistral: the tokenizer is the"),
    (["--max-logprobs", "20"], True, "--max-logprobs 20: a token lists up to 20"),
    (["--max-logprobs", "5"], False, "--max-logprobs 5: a token lists up to 20"),
    (["--shutdown-timeout", "0"], True, "--shutdown-timeout 0: vLLM aborts"),
    (["--num-gpu-blocks-override", "100"], False, "--num-gpu-blocks-override 100: the KV"),
    (["--device-ids", "0,1"], False, "--device-ids 0,1: a worker serves a model on one device"),
    (["--api-key", "k1", "k2"], False, "--api-key: 1 more keys"),
    (["--max-model-len", "-1"], True, "--max-model-len -1: up to the model's context"),
    (["--dtype", "half", "--kv-cache-dtype", "float16"], True, "--kv-cache-dtype float16: the"),
    (["--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16"], True, "--kv-cache-dtype bfloat16: the"),
    (["--kv-cache-dtype", "fp8_e4m3"], False, "--kv-cache-dtype fp8_e4m3: the KV cache has"),
    (["--kv-cache-dtype", "fp8"], False, "--kv-cache-dtype fp8: the KV cache has the model's"),
    (["--no-trust-request-chat-template"], True, "--no-trust-request-chat-template: a request's"),
    (["--runner", "pooling", "--seed", "3"], True, "--seed 3: a pooling model samples nothing"),
])  # fmt: skip
def test_flags_needing_nothing_or_without_equivalent_are_listed_with_why(
    tmp_path: Path, flags: list[str], needless: bool, listed: str
) -> None:
    code, _, _, stderr = run(tmp_path, ["serve", "/m/x", *flags])
    assert code == 0, stderr
    text = (tmp_path / "fleet.toml").read_text()
    section = text.split("# No equivalent")[0 if needless else 1]
    assert f"#   {listed}" in section
    assert (f"no equivalent: {listed}" in stderr) is not needless


@pytest.mark.parametrize(("argv", "flags"), [
    (["m", "--max_num_seqs=4", "--gpu-memory-util", "0.8"],
     [("--max-num-seqs", ("4",)), ("--gpu-memory-utilization", ("0.8",))]),
    (["m", "-O3", "-O", "2", "-O=1"], [("--optimization-level", (v,)) for v in "321"]),
    (["m", "--hf-token", "--port", "1", "--hf-token", "hf_x"],
     [("--hf-token", ()), ("--port", ("1",)), ("--hf-token", ("hf_x",))]),
    (["m", "-dp", "2", "--device-memory-utilization", "0.5", "-dpm"],
     [("--data-parallel-size", ("2",)), ("--gpu-memory-utilization", ("0.5",)),
      ("--data-parallel-multi-port-external-lb", ())]),
    (["m", "--compilation-config.pass_config.fuse", "true", "--x.l+", "a,b", "--x.l+=c"],
     [("--compilation-config", ('{"pass_config": {"fuse": true}}',)),
      ("--x", ('{"l": ["a", "b", "c"]}',))]),
    (["m", "--api-key", "a", "b", "--offset", "-1", "--zap", "-O", "decode"],
     [("--api-key", ("a", "b")), ("--offset", ("-1",)), ("--zap", ()), ("-O", ("decode",))]),
])  # fmt: skip
def test_the_command_line_is_split_as_vllms_parser_splits_it(
    argv: list[str], flags: list[tuple[str, tuple[str, ...]]]
) -> None:
    serve = read_serve(["vllm", "serve", *argv])
    assert serve.model == "m"
    assert [(f.name, f.values) for f in serve.flags] == flags


@pytest.mark.parametrize("argv", [
    ["m", "--enforce-eager=true"],  # a switch takes no value
    ["m", "--max-num-seqs"],  # nor can a flag that takes one go without it
    ["m", "--api-key", "--port", "1"],
])  # fmt: skip
def test_what_vllms_parser_refuses_is_refused(argv: list[str]) -> None:
    with pytest.raises(VllmArgsError):
        read_serve(argv)


def test_flags_vllm_appends_to_add_up() -> None:
    argv = ["m", "--middleware", "a.b", "--port", "1", "--middleware", "c.d", "--port", "2"]
    flags = read_serve(argv).last()
    assert (flags["--middleware"].values, flags["--port"].values) == (("a.b", "c.d"), ("2",))


def test_numbers_with_suffixes_read_as_vllms() -> None:
    assert [human_int(t) for t in ("8k", "8K", "25.6k", "2G", "1m", "77")] == [
        8000, 8192, 25_600, 2 * 1024**3, 1_000_000, 77]  # fmt: skip
    with pytest.raises(ValueError, match="no decimals"):
        human_int("1.5K")


def test_off_forms_are_the_switches_own() -> None:
    assert OFF["--disable-log-requests"] == "--enable-log-requests"
    assert OFF["--no-enable-prefix-caching"] == OFF["--disable-prefix-caching"]
    assert OFF["--enable-uvicorn-access-log"] == "--disable-uvicorn-access-log"
    assert OFF["--no-trust-remote-code"] == "--trust-remote-code"
    assert "--disable-trust-remote-code" not in ARITY


def test_flags_not_in_vllm_still_exit_2(tmp_path: Path) -> None:
    # --worker-use-ray left vllm serve; --max-num could be any of three flags (argparse refuses it)
    argv = ["serve", "/m/x", "--worker-use-ray", "--max-num", "4", "--guided-decoding-backend",
            "xgrammar", "--max-num-seq", "8"]  # fmt: skip
    code, _, _, stderr = run(tmp_path, argv)
    assert code == 2
    for flag in ("--worker-use-ray", "--max-num 4", "--guided-decoding-backend xgrammar"):
        assert f"  {flag}\n" in stderr
    assert "--max-num-seq" not in stderr  # the one flag it begins: --max-num-seqs


def test_speculative_flags_vllm_would_refuse_are_refused(tmp_path: Path) -> None:
    both = ["serve", "/m/x", "--speculative-config", '{"method": "ngram"}', "--spec-method",
            "ngram"]  # fmt: skip
    code, _, _, stderr = run(tmp_path, both)
    assert code == 2 and "--speculative-config sets method too" in stderr
    code, _, _, stderr = run(tmp_path, ["serve", "/m/x", "--spec-method", "eagle3"])
    assert code == 2 and "--spec-method eagle3" in stderr and "method" in stderr


def test_the_newer_options_start_the_text_generation_runner(tmp_path: Path, tiny_lm: Path) -> None:
    """The settings written from the newer flags are those the runner takes (tiny Llama)."""
    pytest.importorskip("torch")

    argv = ["vllm", "serve", str(tiny_lm), "--served-model-name", "tiny", "--dtype", "float32",
            "--max-num-seqs", "16", "--max-num-active-seqs", "6", "--block-size", "16",
            "--num-gpu-blocks-override", "64", "--no-async-scheduling", "--spec-tokens", "3",
            "--max-model-len", "0.5k", "--chat-template", "{{ messages[0]['content'] }}|{{ x }}",
            "--default-chat-template-kwargs", '{"x": 1}', "--trust-request-chat-template",
            "--chat-template-content-format", "string"]  # fmt: skip
    runner, _ = started_runner(tmp_path, argv, "tiny")
    assert (runner.max_running, runner.page_size, runner.kv_cache_tokens) == (6, 16, 1024)
    assert runner.schedule_ahead is False
    assert runner.speculative is not None and runner.max_prompt_tokens == 499
    assert runner.tokenizer.chat_template == "{{ messages[0]['content'] }}|{{ x }}"
    assert (runner.templates.default_kwargs, runner.templates.trust_request) == ({"x": 1}, True)
    assert runner.templates.content_format == "string"


def test_secrets_are_never_shown(tmp_path: Path) -> None:
    argv = ["serve", "/m/x", "--api_key", "sk-one", "sk-two", "--hf-token", "-O3",
            "--hf-tok=hf_secret"]  # fmt: skip
    code, _, gateway, stderr = run(tmp_path, argv)
    assert code == 0, stderr
    text = (tmp_path / "fleet.toml").read_text()
    for secret in ("sk-one", "sk-two", "hf_secret"):
        assert secret not in text and secret not in stderr
    assert "--hf-token -O3" in text  # a bare --hf-token hides no flag after it
    assert "--api-key sk-one" in gateway  # the command printed for the operator keeps it
