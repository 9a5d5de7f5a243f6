"""``batchfleet from-vllm`` reads a ``vllm run-batch`` command line (vLLM's
``run_batch.make_arg_parser``): the engine flags become the fleet file as ``vllm serve``'s
do, its own flags the ``batchfleet run-batch`` command, or are listed with why."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from vllm_commands import tomllib

from batchfleet import cli
from batchfleet.config import load_config
from batchfleet.from_vllm import from_vllm
from batchfleet.vllm_run_batch import ARITY, CARRIED, NEEDLESS


def _run(tmp_path: Path, argv: list[str]) -> tuple[int, str, str]:
    return from_vllm(argv, out=str(tmp_path / "fleet.toml"), env={})


def _command(stdout: str) -> list[str]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("batchfleet run-batch"))
    return shlex.split(line)[1:]


def test_every_flag_of_vllm_run_batch_has_a_meaning_here() -> None:
    assert sorted(ARITY) == sorted({*CARRIED, *NEEDLESS})


def test_a_run_batch_command_line_becomes_a_fleet_file_and_the_run_batch_command(
    tmp_path: Path,
) -> None:
    # Given vLLM's run-batch with engine flags, its own flags, and two served names
    argv = ["vllm", "run-batch", "-i", "in.jsonl", "-o", "https://b/out.jsonl",
            "--output_tmp_dir=/scratch", "--model", "/models/Qwen3-8B", "--max-model-len",
            "8192", "--served-model-name", "qwen3", "Qwen/Qwen3-8B", "--response-role",
            "bot", "--enable-metrics", "--url", "127.0.0.1", "--port", "9100",
            "--max-log-len", "100", "--enable-force-include-usage",
            "--enable-prompt-tokens-details", "--spec-method", "ngram", "--spec-tokens", "3"]  # fmt: skip
    code, stdout, stderr = _run(tmp_path, argv)
    assert code == 0, stderr
    # Then the fleet file serves the model under its first served name, the engine flags
    # mapped as for serve (speculation with vLLM's n-gram defaults)
    fleet = tomllib.loads((tmp_path / "fleet.toml").read_text())
    model = fleet["models"]["qwen3"]
    assert (model["path"], model["max_tokens"]) == ("/models/Qwen3-8B", 8191)
    assert model["options"]["speculative"] == {"method": "ngram", "num_speculative_tokens": 3}
    cfg = load_config(tmp_path / "fleet.toml")
    assert cfg.models["qwen3"].options["speculative"]["method"] == "ngram"
    # and the run-batch command answers the same file, every served name mapped
    args = cli.build_parser().parse_args(_command(stdout))
    assert (args.input_file, args.output_file, args.output_tmp_dir) == (
        "in.jsonl", "https://b/out.jsonl", "/scratch")  # fmt: skip
    assert (args.model, args.model_map) == ("qwen3", ["Qwen/Qwen3-8B=qwen3"])
    assert args.response_role == "bot"
    assert args.config == str(tmp_path / "fleet.toml")
    # and its Prometheus server where vLLM's was
    assert (args.enable_metrics, args.url, args.port) == (True, "127.0.0.1", 9100)
    # and what needs nothing is said, not the serve-only notes
    text = (tmp_path / "fleet.toml").read_text()
    assert "no equivalent" not in stderr
    for flag in ("--max-log-len 100", "--enable-force-include-usage",
                 "--enable-prompt-tokens-details"):  # fmt: skip
        assert f"#   {flag}: " in text
    assert "a model has one name" not in stderr and "clients send" not in stderr
    assert "batchfleet gateway" not in stdout + text
    assert f"#       {shlex.join(['batchfleet', *_command(stdout)])}" in text


@pytest.mark.parametrize(("model", "served", "maps"), [
    (["--model", "/models/opt"], [], ["/models/opt=opt"]),  # lines name the path
    (["--model", "facebook/opt-125m"], [], ["facebook/opt-125m=opt-125m"]),
    (["--model", "/models/opt"], ["--served-model-name", "opt"], []),
    (["--model=/m/x"], ["--served-model-name", "a b"], ["a b=a-b"]),
])  # fmt: skip
def test_the_names_lines_give_reach_the_fleet_s_model(
    tmp_path: Path, model: list[str], served: list[str], maps: list[str]
) -> None:
    code, stdout, stderr = _run(tmp_path, ["run-batch", "-i", "a", "-o", "b", *model, *served])
    assert code == 0, stderr
    args = cli.build_parser().parse_args(_command(stdout))
    assert (args.model_map or []) == maps
    assert args.model in tomllib.loads((tmp_path / "fleet.toml").read_text())["models"]
    assert args.response_role == "assistant"  # vLLM's default, not given
    assert (args.enable_metrics, args.url, args.port) == (False, "0.0.0.0", 8000)  # vLLM's


@pytest.mark.parametrize(("given", "meant"), [
    (["--output-tmp", "/s"], ("output_tmp_dir", "/s")),
    (["--output_tmp=/s"], ("output_tmp_dir", "/s")),
    (["--response", "bot"], ("response_role", "bot")),
    (["--enable-met"], ("enable_metrics", True)),
    (["--ur", "10.0.0.1"], ("url", "10.0.0.1")),
    (["--input", "x.jsonl"], ("input_file", "x.jsonl")),
])  # fmt: skip
def test_run_batch_flags_may_be_abbreviated_as_vllm_s_parser_allows(
    tmp_path: Path, given: list[str], meant: tuple[str, object]
) -> None:
    code, stdout, stderr = _run(tmp_path, ["run-batch", "-i", "a", "-o", "b", "--model", "m",
                                           *given])  # fmt: skip
    assert code == 0, stderr
    args = cli.build_parser().parse_args(_command(stdout))
    assert getattr(args, meant[0]) == meant[1]


@pytest.mark.parametrize("given", [
    ["--out", "x"],  # --output-file or --output-tmp-dir
    ["--po", "1"],  # --port or the engine's --pooler-config
    ["--max-log", "5"],  # --max-log-len or the engine's --max-logprobs
])  # fmt: skip
def test_an_ambiguous_abbreviation_is_refused(tmp_path: Path, given: list[str]) -> None:
    code, stdout, stderr = _run(tmp_path, ["run-batch", "-i", "a", "-o", "b", "--model", "m",
                                           *given])  # fmt: skip
    assert (code, stdout) == (2, ""), stderr
    assert f"ambiguous option: {given[0]} could match --" in stderr


@pytest.mark.parametrize(("argv", "error"), [
    (["run-batch", "-i", "a", "--model", "m"], "needs -o/--output-file"),
    (["run-batch", "-o", "b", "--model", "m"], "needs -i/--input-file"),
    (["run-batch", "-i", "a", "-o"], "-o: expected one value"),
    (["run-batch", "-i", "a", "-o", "b", "--model", "m", "--max-num-seqs", "x"],
     "--max-num-seqs"),
    (["run-batch", "-i", "a", "-o", "b", "--model", "m", "--no-such-flag"], "--no-such-flag"),
])  # fmt: skip
def test_a_bad_run_batch_command_line_is_refused(
    tmp_path: Path, argv: list[str], error: str
) -> None:
    code, stdout, stderr = _run(tmp_path, argv)
    assert (code, stdout) == (2, "")
    assert error in stderr
    assert not (tmp_path / "fleet.toml").exists()


def test_a_server_flag_is_listed_as_run_batch_s_no_equivalent(tmp_path: Path) -> None:
    argv = ["run-batch", "-i", "a", "-o", "b", "--model", "m", "--api-key", "k1", "--port", "1"]
    code, stdout, stderr = _run(tmp_path, argv)
    assert code == 0, stderr
    assert "no equivalent: --api-key: a server flag" in stderr and "k1" not in stderr
    assert "--api-key" not in _command(stdout) and "--host" not in _command(stdout)
