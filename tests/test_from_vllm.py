"""``batchfleet from-vllm``: realistic ``vllm serve`` command lines → fleet files (read back
with tomllib and loaded by the fleet loader) and gateway commands (read back by the CLI's
own parser)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from vllm_commands import run, started_runner

from batchfleet import cli
from batchfleet.config import load_config

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


CASES: list[tuple[str, list[str], dict[str, Any], dict[str, Any]]] = [
    (
        "tools, LoRA in both forms, speculative, TP refused",
        ["vllm", "serve", "/models/Qwen3-8B", "--served-model-name", "qwen3",
         "--max-model-len", "8192", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--reasoning-parser", "qwen3", "--enable-lora", "--max-loras", "4",
         "--max-lora-rank", "32", "--lora-modules", "sql=/loras/sql",
         '{"name": "fr", "path": "/loras/fr", "base_model_name": "qwen3"}',
         "--speculative-config", SPEC, "-tp", "2", "--dtype", "bfloat16",
         "--host", "10.0.0.5", "--port", "9000", "--disable-log-requests"],
        {"path": "/models/Qwen3-8B", "dtype": "bfloat16", "max_tokens": 8191,
         "limits": {"max_new_tokens": 8191, "max_text_chars": 1_000_000,
                    "max_entry_bytes": 8 * 1_048_576},
         "options": {"max_running": 32, "step_tokens": 2048, "tool_call_parser": "hermes",
                     "reasoning_parser": "qwen3", "max_loras": 4, "max_lora_rank": 32,
                     "speculative": json.loads(SPEC), "generation_config": "auto", "seed": 0,
                     "lora_adapters": {"sql": "/loras/sql", "fr": "/loras/fr"}}},
        {"name": "qwen3", "host": "10.0.0.5", "port": 9000,
         "unsupported": ["--tensor-parallel-size 2"],
         "needless": ["--enable-auto-tool-choice", "--enable-lora", "--disable-log-requests"]},
    ),
    (
        "serve prefix, --model=, prefix caching off, data parallel, defaults vLLM's",
        ["serve", "--model=/m/llama", "--no-enable-prefix-caching", "--block-size", "16",
         "--data-parallel-size", "4", "--return-tokens-as-token-ids", "--dtype", "float",
         "--generation-config", "vllm", "--override-generation-config",
         '{"max_new_tokens": 512, "temperature": 0.2, "top_k": 20, "do_sample": true}'],
        {"path": "/m/llama", "dtype": "float32", "max_tokens": 65_536,
         "limits": {"max_new_tokens": 65_536, "max_text_chars": 1_000_000,
                    "max_entry_bytes": 8 * 1_048_576},
         "options": {"prefix_cache_tokens": 0, "page_size": 16,
                     "override_generation_config": {"max_new_tokens": 512, "temperature": 0.2,
                                                    "top_k": 20},
                     "seed": 0}},
        {"name": "llama", "host": "0.0.0.0", "port": 8000, "token_ids": True, "dp": 4,
         "unsupported": ["--override-generation-config do_sample"],
         "needless": ["--data-parallel-size 4: run 4 workers", "--generation-config vllm"]},
    ),
    (
        "hub id, GGUF-free, pipeline parallel refused, quantization refused, defaults' folder",
        ["Qwen/Qwen2.5-0.5B-Instruct", "--pipeline-parallel-size", "2", "-q", "awq",
         "--generation-config", "/cfg/qwen",
         "--gpu-memory-utilization", "0.85", "--reasoning-config",
         '{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}'],
        {"path": "Qwen/Qwen2.5-0.5B-Instruct",
         "options": {"reasoning_config": {"reasoning_start_str": "<think>",
                                          "reasoning_end_str": "</think>"},
                     "generation_config": "/cfg/qwen", "seed": 0}},
        {"name": "Qwen2.5-0.5B-Instruct", "host": "0.0.0.0", "port": 8000,
         "unsupported": ["--pipeline-parallel-size 2", "--quantization awq",
                         "the model name 'Qwen/Qwen2.5-0.5B-Instruct': a fleet's",
                         "--gpu-memory-utilization 0.85"]},
    ),
    (
        "a GGUF file",
        ["vllm", "serve", "/w/smol/SmolLM2-135M-Instruct.Q4_1.gguf", "--quantization", "gguf",
         "--tokenizer", "/w/base-tokenizer"],
        {"path": "/w/smol", "options": {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                                        "generation_config": "auto", "seed": 0}},
        {"name": "SmolLM2-135M-Instruct.Q4_1", "host": "0.0.0.0", "port": 8000,
         "needless": ["--quantization gguf"], "unsupported": ["--tokenizer /w/base-tokenizer"]},
    ),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "model", "expect"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_command_lines_become_fleet_files_and_gateway_commands(
    tmp_path: Path, argv: list[str], model: dict[str, Any], expect: dict[str, Any]
) -> None:
    code, fleet, gateway, stderr = run(tmp_path, argv)
    assert code == 0, stderr
    # the model, its options
    ((name, got),) = fleet["models"].items()
    assert name == expect["name"]
    assert got["runner"] == "text-generation"
    for key, value in model.items():
        assert got[key] == value, key
    assert set(got["options"]) == set(model.get("options", {}))
    # the gateway command, as the CLI reads it
    args = cli.build_parser().parse_args(shlex.split(gateway.split("  #")[0])[1:])
    assert (args.host, args.port) == (expect["host"], expect["port"])
    assert args.config == str(tmp_path / "fleet.toml")
    assert args.return_tokens_as_token_ids is expect.get("token_ids", False)
    assert args.data_parallel_size == expect.get("dp", 1)  # its fingerprint's dpN
    # what has no equivalent: on stderr and in a comment; what needs nothing: a comment
    text = (tmp_path / "fleet.toml").read_text()
    for flag in expect.get("unsupported", []):
        assert f"no equivalent: {flag}" in stderr
        assert f"#   {flag}" in text
    for flag in expect.get("needless", []):
        assert f"#   {flag}" in text
        assert flag not in stderr


def test_every_line_cites_its_flag(tmp_path: Path) -> None:
    code, _, _, _ = run(tmp_path, CASES[0][1])
    assert code == 0
    lines = (tmp_path / "fleet.toml").read_text().splitlines()
    assert "max_running = 32  # --max-num-seqs 32" in lines
    assert 'sql = "/loras/sql"  # --lora-modules sql=/loras/sql' in lines
    assert any(ln.startswith("max_tokens = 8191  # --max-model-len 8192") for ln in lines)


def test_unknown_flags_exit_2_unless_keep_going(tmp_path: Path) -> None:
    argv = ["vllm", "serve", "/m/x", "--max-num-seqs", "8", "--frobnicate", "3", "--zap"]
    code, _, _, stderr = run(tmp_path, argv)
    assert code == 2
    assert "--frobnicate 3" in stderr and "--zap" in stderr
    assert not (tmp_path / "fleet.toml").exists()

    code, fleet, _, stderr = run(tmp_path, argv, keep_going=True)
    assert code == 0
    assert fleet["models"]["x"]["options"] == {
        "max_running": 8,
        "generation_config": "auto",
        "seed": 0,
    }
    text = (tmp_path / "fleet.toml").read_text()
    assert "#   --frobnicate 3" in text and "#   --zap" in text
    assert "dropped (unknown): --frobnicate 3" in stderr


@pytest.mark.parametrize(("flag", "value", "why"), [
    ("--tool-call-parser", "nope", "the fleet reads"),
    ("--reasoning-parser", "nope", "the fleet splits"),
    ("--speculative-config", '{"method": "eagle", "model": "x"}', "method"),
    ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "k": 1}',
     "unknown keys"),
    ("--speculative-config", '{"model": "/m/s", "num_speculative_tokens": 4, "revision": "v2"}',
     "revision is not served: the draft model is a local directory"),
    ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
     '"disable_by_batch_size": 1}', "at least 2"),
    ("--reasoning-config", '{"reasoning_end_str": ""}', "reasoning_end_str"),
    ("--lora-modules", "no-path", "name=path"),
    ("--max-lora-rank", "1024", "up to 512"),
    ("--max-num-seqs", "0", "positive"),
    ("--dtype", "fp8", "the fleet takes"),
    ("--port", "http", "invalid literal"),
    ("--port", "70000", "not a TCP port"),
    ("--override-generation-config", '{"top_p": 1.5}', "top_p: Input should be less than"),
    ("--override-generation-config", '[1]', "a JSON object"),
    ("--chat-template", "{% for m in messages %}", "does not compile"),
    ("--chat-template-content-format", "parts", "not one of auto, string, openai"),
    ("--default-chat-template-kwargs", '{"tools": []}', "may not set tools"),
])  # fmt: skip
def test_values_the_fleet_would_refuse_are_refused_here(
    tmp_path: Path, flag: str, value: str, why: str
) -> None:
    code, _, _, stderr = run(tmp_path, ["serve", "/m/x", flag, value])
    assert code == 2
    assert flag in stderr and why in stderr


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8,
     "disable_padded_drafter_batch": True, "enforce_eager": True},
    {"model": "/m/small", "num_speculative_tokens": 3, "max_model_len": 2048,
     "num_speculative_tokens_per_batch_size": [[1, 8, 3], [9, 32, 1], [33, 256, 0]],
     "draft_tensor_parallel_size": 1, "rejection_sample_method": "standard"},
])  # fmt: skip
def test_the_speculative_keys_served_pass_through(tmp_path: Path, spec: dict[str, Any]) -> None:
    given = {**spec, "quantization": None}  # a null is vLLM's default: left out
    code, fleet, _, _ = run(tmp_path, ["serve", "/m/x", "--speculative-config", json.dumps(given)])
    assert code == 0 and fleet["models"]["x"]["options"]["speculative"] == spec


def test_config_yaml_is_read_and_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("model: /m/phi\nport: 7000\nmax-num-seqs: 8\nmax_num_batched_tokens: 1024\n"
                      "enable-prefix-caching: false\nlora-modules:\n  - a=/l/a\n  - b=/l/b\n")  # fmt: skip
    code, fleet, gateway, stderr = run(tmp_path, ["--config", str(config), "--max-num-seqs", "4"])
    assert code == 0, stderr
    opts = fleet["models"]["phi"]["options"]
    assert opts["max_running"] == 4  # the command line's
    assert opts["step_tokens"] == 1024
    assert opts["prefix_cache_tokens"] == 0
    assert opts["lora_adapters"] == {"a": "/l/a", "b": "/l/b"}
    assert "--port 7000" in gateway


def test_kv_cache_bytes_become_tokens_from_the_models_config(tmp_path: Path) -> None:
    model = tmp_path / "lm"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 256,
                                                   "num_attention_heads": 8,
                                                   "num_key_value_heads": 2}))  # fmt: skip
    # 2 (K, V) x 4 layers x 2 heads x 32 dims x 2 bytes = 1024 bytes a token
    code, fleet, _, stderr = run(tmp_path, [str(model), "--kv-cache-memory-bytes", "1048576"])
    assert code == 0, stderr
    assert fleet["models"]["lm"]["options"]["kv_cache_tokens"] == 1024
    code, fleet, _, _ = run(tmp_path, [str(model), "--kv-cache-memory-bytes", "1048576",
                                       "--dtype", "float32"])  # fmt: skip
    assert fleet["models"]["lm"]["options"]["kv_cache_tokens"] == 512
    # a bfloat16 KV cache of a float32 model: 2 bytes a number again, whichever flag is first
    code, fleet, _, _ = run(tmp_path, [str(model), "--kv-cache-memory-bytes", "1048576",
                                       "--kv-cache-dtype", "bfloat16", "--dtype", "float32"])  # fmt: skip
    assert fleet["models"]["lm"]["options"]["kv_cache_tokens"] == 1024
    assert fleet["models"]["lm"]["options"]["kv_cache_dtype"] == "bfloat16"
    code, fleet, _, stderr = run(tmp_path, ["/nowhere/lm", "--kv-cache-memory-bytes", "1048576"])
    assert code == 0 and "kv_cache_tokens" not in fleet["models"]["lm"].get("options", {})
    assert "no equivalent: --kv-cache-memory-bytes 1048576" in stderr


def test_vllm_environment_switches_and_the_api_key(tmp_path: Path) -> None:
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1"}
    argv = ["/m/x", "--api-key", "sk-secret", "--hf-token=hf_secret", "--whatever", "1"]
    code, _, gateway, stderr = run(tmp_path, argv, env=env, keep_going=True)
    assert code == 0
    args = cli.build_parser().parse_args(shlex.split(gateway)[1:])
    assert args.allow_runtime_lora_updating and args.server_dev_mode
    assert args.api_key == "sk-secret"
    text = (tmp_path / "fleet.toml").read_text()
    assert "sk-secret" not in text  # a fleet file is no place for the key
    assert "hf_secret" not in text and "hf_secret" not in stderr
    assert "#   --hf-token ***: " in text
    assert "BATCHFLEET_API_KEY" in text
    _, _, _, stderr = run(tmp_path, ["/m/x"], env={"VLLM_API_KEY": "sk-env"})
    assert "env VLLM_API_KEY: the gateway reads BATCHFLEET_API_KEY" in stderr


def test_cli_writes_the_file_and_prints_the_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "f.toml"
    code = cli.main(["from-vllm", "--out", str(out), "--", "vllm", "serve", "/m/x",
                     "--max-num-seqs", "8", "--port", "8100"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"batchfleet worker --config {out}"
    assert printed[1] == f"batchfleet gateway --config {out} --host 0.0.0.0 --port 8100"
    assert load_config(out).models["x"].options == {
        "max_running": 8,
        "generation_config": "auto",
        "seed": 0,
    }

    assert cli.main(["from-vllm", "--", "serve", "/m/x", "--what"]) == 2
    assert "--what" in capsys.readouterr().err
    assert cli.main(["from-vllm", "/m/x", "--max-num-seqs", "2"]) == 0  # without --
    assert tomllib.loads(capsys.readouterr().out)["models"]["x"]["options"]["max_running"] == 2


def test_the_fleet_file_starts_the_text_generation_runner(tmp_path: Path, tiny_lm: Path) -> None:
    """The options written are those the runner takes: it starts with them (tiny Llama)."""
    pytest.importorskip("torch")
    argv = ["vllm", "serve", str(tiny_lm), "--served-model-name", "tiny", "--dtype", "float32",
            "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--block-size", "16", "--kv-cache-memory-bytes", str(2048 * 1024),
            "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
            "--speculative-config", SPEC, "--override-generation-config",
            '{"max_new_tokens": 64, "temperature": 0.7}']  # fmt: skip
    runner, cfg = started_runner(tmp_path, argv, "tiny")
    assert (runner.max_running, runner.step_tokens, runner.page_size) == (8, 64, 16)
    assert runner.max_prompt_tokens == 511 and cfg.limits.max_new_tokens == 511
    assert runner.tool_call_parser == "hermes" and runner.reasoning_parser == "qwen3"
    assert runner.speculative is not None and runner.default_new_tokens == 64
    assert runner.sampling_defaults.sampling == {"temperature": 0.7}  # over the model's (none)
    # 2 MiB over 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 4 bytes (float32)
    assert runner.kv_cache_tokens == 2048 * 1024 // (2 * 2 * 2 * 16 * 4)


def test_a_fleet_file_the_loader_refuses_is_not_written(tmp_path: Path) -> None:
    from batchfleet.from_vllm import ConversionError, check

    with pytest.raises(ConversionError, match="would not load"):
        check('[models.x]\nrunner = "text-generation"\nlanes = 0\n')
    check('[models.x]\nrunner = "text-generation"\nlanes = 2\n')
