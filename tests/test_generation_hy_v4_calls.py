"""HY-V4's tool calls (vLLM's ``hy_v4`` tool parser): GLM-4.5's blocks in a
``<tool_calls>`` section, every tag ending in the suffix its checkpoint's vocabulary
tells, resolved at load; read whole and streamed a character at a time, for two
checkpoints with different suffixes."""

from __future__ import annotations

from pathlib import Path

import pytest
from devices import DEVICE

pytest.importorskip("torch")

from batchfleet.schemas.tools import ToolUse
from batchfleet.worker.generation import hy_v4, strict_calls
from batchfleet.worker.generation.tools import PARSERS, CallReader, read_calls
from batchfleet.worker.runners.generation import TextGenerationRunner
from conftest import TINY_LM_OPTIONS
from test_generation_reasoning import generate
from test_generation_tool_formats import _args, _streams_as_read
from tiny_models import make_causal_lm

AUTO = ToolUse("auto")
TYPES = {"get_weather": {"city": "string", "days": "integer", "metric": "boolean",
                         "opts": "object", "temp": "number"}}  # fmt: skip
SUFFIXES = (":6124c78e", ":ab12")


def _vocab(suffix: str) -> list[str]:
    return ["a", *hy_v4.tags(suffix), f"<think{suffix}>", f"</think{suffix}>"]


def _text(suffix: str) -> str:
    """Some content, then two calls (the second with no arguments)."""
    sc, sc_, c, c_, k, k_, v, v_ = hy_v4.tags(suffix)
    pair = "".join(f"{k}{key}{k_}{v}{value}{v_}" for key, value in (
        ("city", "Paris"), ("days", "3"), ("metric", "True"), ("opts", '{"a": [1]}'),
        ("temp", "1e1"), ("note", " as is ")))  # fmt: skip
    return f"Let me look.\n{sc}{c}get_weather{pair}{c_}{c}get_time{c_}{sc_}"


WANT = [("get_weather", {"city": "Paris", "days": 3, "metric": True, "opts": {"a": [1]},
                         "temp": 10.0, "note": " as is "}), ("get_time", {})]  # fmt: skip


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_hy_v4_calls_are_read_and_streamed_with_the_vocabularys_suffix(suffix: str) -> None:
    parser = hy_v4.parser_for(_vocab(suffix))
    assert parser == f"hy_v4{suffix}"
    text = _text(suffix)
    assert _args(_streams_as_read(parser, text, TYPES)) == WANT
    reader = CallReader(AUTO, parser, TYPES)
    reader.read(text, final=True)
    assert reader.content == "Let me look."
    # the other checkpoint's tags, or none, are text to this one's parser
    other = next(s for s in SUFFIXES if s != suffix)
    assert read_calls(AUTO, _text(other), parser, TYPES) is None
    assert read_calls(AUTO, _text(""), parser, TYPES) is None
    assert _args(read_calls(AUTO, _text(""), "hy_v4", TYPES)) == WANT  # unsuffixed tags
    assert "hy_v4" in PARSERS
    # strict functions are held in the same tags
    grammar = strict_calls.grammar(parser, [("get_time", {"type": "object"}, True)], True,
                                   lambda m: None)  # fmt: skip
    assert grammar is not None and f'"<tool_call{suffix}>get_time"' in grammar
    assert f'"</tool_calls{suffix}>"' in grammar and f'"</tool_calls{other}>"' not in grammar


@pytest.mark.parametrize(
    "body",
    [
        "",  # no name
        "get_weather<arg_key{s}>city</arg_key{s}><arg_value{s}>Paris",  # cut
    ],
)
def test_a_hy_v4_call_written_badly_is_content(body: str) -> None:
    s = SUFFIXES[0]
    parser = hy_v4.parser_for(_vocab(s))
    text = f"Hi.<tool_calls{s}><tool_call{s}>{body.format(s=s)}</tool_call{s}></tool_calls{s}>"
    if "Paris" in body:
        text = text.removesuffix(f"</tool_call{s}></tool_calls{s}>")
    assert read_calls(AUTO, text, parser, TYPES) is None


def test_a_vocabulary_without_the_section_tags_is_refused() -> None:
    with pytest.raises(ValueError, match=r"hy_v4.*<tool_calls:x>"):
        hy_v4.parser_for(["<think:x>", "</think:x>", "<tool_call:x>"])


@pytest.fixture(scope="module")
def hy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose tokenizer has HY-V4's structural tokens, suffixed."""
    return make_causal_lm(tmp_path_factory.mktemp("tiny-hy-v4"),
                          specials=tuple(_vocab(SUFFIXES[1])[1:]))  # fmt: skip


def test_a_runner_reads_hy_v4_calls_with_its_tokenizers_suffix(hy: Path) -> None:
    s = SUFFIXES[1]
    options = {**TINY_LM_OPTIONS, "tool_call_parser": "hy_v4", "reasoning_parser": "hy_v4"}
    runner = TextGenerationRunner(hy, device=DEVICE, dtype="float32", options=options)
    assert runner._calls_parser == f"hy_v4{s}"
    think = f"<think{s}>weather</think{s}>"
    pieces = [think, *_text(s).replace("<", "\0<").replace(">", ">\0").split("\0")]
    props = {k: {"type": t} for k, t in TYPES["get_weather"].items()}
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": p}}} for n, p in (("get_weather", props), ("get_time", {}))]  # fmt: skip
    chunks, out = generate(runner, "hy", [p for p in pieces if p], stream=True, tools=tools)
    assert out["text"] == think + _text(s)  # its special tokens kept
    assert out["reasoning_content"] == "weather" and out["content"] == "Let me look."
    assert _args(out["tool_calls"]) == WANT
    assert [c for ch in chunks for c in ch.get("tool_calls", ())] == out["tool_calls"]
