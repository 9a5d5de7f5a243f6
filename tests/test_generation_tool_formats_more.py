"""More tool-call formats read as vLLM's parsers of the same name read them, past the
table-driven checks of ``test_generation_tools``: ``minicpm5``'s parameters and the calls
it refuses, ``dots``'s JSON fallback, ``kimi_k3``'s XTML channels (with its reasoning
parser's answer, and its special tokens kept), ``minimax_m3``'s tags; each read whole, and
streamed split at every character."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from batchfleet.schemas.tools import ToolUse
from batchfleet.worker.generation.reasoning import Reasoning
from batchfleet.worker.generation.tools import CallReader, read_calls
from batchfleet.worker.runners.generation import TextGenerationRunner
from conftest import TINY_LM_OPTIONS
from devices import DEVICE
from test_generation_reasoning import generate
from test_generation_reasoning_parsers import K3_END, K3_RESPONSE, K3_THINK, SPECIALS, runner_for
from test_generation_tool_formats import _args, _streams_as_read
from tiny_models import make_causal_lm

AUTO = ToolUse("auto")


def _call(name: str, params: str, quote: str = '"') -> str:
    return f"<function name={quote}{name}{quote}>\n{params}</function>"


def test_minicpm5_values_are_typed_as_vllm_does() -> None:
    types = {"f": {"s": "string", "i": "integer", "o": "object", "b": "boolean"}}
    params = ('<param name="s"> 42 </param>\n<param name="i">42</param>\n'
              "<param name=\"o\">{'k': [1, None]}</param>\n<param name=\"b\">true</param>\n"
              '<param name="free">[1, 2]</param>\n<param name="amp">a &amp; b &lt;c&gt;</param>\n'
              '<param name="raw"><![CDATA[ <x> & y ]]></param>\n'
              '<param name="bad">not json</param>\n')  # fmt: skip
    text = "Let me see.\n" + _call("f", params) + "\n" + _call("f", "", "'")
    calls = _streams_as_read("minicpm5", text, types)
    assert _args(calls) == [
        ("f", {"s": "42", "i": 42, "o": {"k": [1, None]}, "b": True, "free": [1, 2],
               "amp": "a & b <c>", "raw": " <x> & y ", "bad": "not json"}),
        ("f", {})]  # fmt: skip
    # the parameters may sit in an <arguments> element
    wrapped = _call("f", '<arguments><param name="i">7</param></arguments>')
    assert _args(read_calls(AUTO, wrapped, "minicpm5", types)) == [("f", {"i": 7})]


@pytest.mark.parametrize(
    "params",
    ['<param name="i">1</param><param name="i">2</param>',  # written twice
     '<param>1</param><param name="i">2</param>'],  # without its name
)  # fmt: skip
def test_minicpm5_a_call_written_badly_is_content(params: str) -> None:
    types = {"f": {"i": "integer"}, "g": {}}
    text = "Sure. " + _call("f", params) + _call("g", "")
    reader = CallReader(AUTO, "minicpm5", types)
    reader.read(text, final=True)
    assert _args(reader.calls) == [("g", {})]  # the bad block is left as written
    assert reader.content == "Sure. " + _call("f", params)


def test_minicpm5_calls_only_the_requests_functions() -> None:
    text = "Sure. " + _call("unknown", '<param name="x">1</param>')
    assert read_calls(AUTO, text, "minicpm5", {"f": {}}) is None
    assert read_calls(AUTO, text, "minicpm5") is None
    # and streams nothing for it
    reader = CallReader(AUTO, "minicpm5", {"f": {}})
    for end in range(len(text) + 1):
        reader.read(text[:end])
    assert reader.calls == []


def test_dots_reads_a_section_that_is_one_json_call() -> None:
    types = {"search": {"query": "string"}, "b": {}}
    open_, close = "<dots_function_call>", "</dots_function_call>"
    text = (f'Searching.\n{open_}\n{{"name": "search", "parameters": {{"query": "weather"}}}}\n'
            f'{close}\n{open_}\n<invoke name="b">\n</invoke>\n{close}')  # fmt: skip
    calls = _streams_as_read("dots", text, types)
    assert _args(calls) == [("search", {"query": "weather"}), ("b", {})]
    reader = CallReader(AUTO, "dots", types)
    reader.read(text, final=True)
    assert reader.content == "Searching."
    for bad in [
        '{"name": "other", "arguments": {}}',  # not the request's
        '{"name": "search", "arguments": "{}"}',  # arguments not an object
        '{"name": "search", "arguments": {}} and more',  # not JSON whole
        '["search"]',
    ]:
        assert read_calls(AUTO, f"{open_}{bad}{close}", "dots", types) is None, bad
    # without arguments: none given (vLLM's)
    bare = f'{open_}{{"name": "b"}}{close}'
    assert [json.loads(c["function"]["arguments"]) for c in read_calls(AUTO, bare, "dots", types)
            or []] == [{}]  # fmt: skip
    # a JSON call cut by the end counts only once the text is whole
    cut = f'{open_}{{"name": "b", "arguments": {{}}}}'
    growing = CallReader(AUTO, "dots", types)
    growing.read(cut)
    assert growing.calls == []
    growing.read(cut, final=True)
    assert _args(growing.calls) == [("b", {})]


def _k3_call(name: str, args: list[tuple[str, str, str]]) -> str:
    return (f'<|open|>call tool="{name}" index="1"<|sep|>'
            + "".join(f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>'
                      for k, t, v in args)
            + "<|close|>call<|sep|>")  # fmt: skip


def test_kimi_k3_values_are_typed_as_the_model_writes_them() -> None:
    args = [("s", "string", "[1]"), ("i", "integer", "7"), ("o", "object", '{"a": [1]}'),
            ("bad", "number", "many"), ("q&quot;uote", "string", ' raw "x" ')]  # fmt: skip
    text = ("<|open|>tools<|sep|>" + _k3_call("f", args) + _k3_call("a&amp;b", [])
            + "<|close|>tools<|sep|>")  # fmt: skip
    # the schema does not type them (vLLM's: the model's type attribute does)
    calls = _streams_as_read("kimi_k3", text, {"f": {"s": "array", "i": "string"}})
    assert _args(calls) == [
        ("f", {"s": "[1]", "i": 7, "o": {"a": [1]}, "bad": "many", 'q"uote': ' raw "x" '}),
        ("a&b", {})]  # fmt: skip
    # a call without a tool is none
    nameless = '<|open|>tools<|sep|><|open|>call index="1"<|sep|><|close|>call<|sep|>'
    assert read_calls(AUTO, nameless, "kimi_k3") is None


@pytest.fixture(scope="module")
def tagged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("tiny-k3"), specials=SPECIALS)


def test_kimi_k3s_tools_channel_follows_its_response_and_is_read(tagged: Path) -> None:
    # the response channel wraps the content; the tools channel after it holds the calls
    runner = runner_for(tagged, "kimi_k3", tool_call_parser="kimi_k3")
    call = _k3_call("get_time", [("zone", "string", "cet")])
    pieces = [K3_THINK[0], "hm", K3_THINK[1], K3_RESPONSE[0], "I will", " check.",
              K3_RESPONSE[1], "<|open|>tools<|sep|>", call, "<|close|>tools<|sep|>", K3_END]  # fmt: skip
    chunks, out = generate(runner, "k3", pieces, stream=True)
    assert (out["reasoning_content"], out["content"]) == ("hm", "I will check.")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]] == [
        ("get_time", '{"zone":"cet"}')
    ]
    for key in ("reasoning_content", "content"):
        assert "".join(c[key] for c in chunks) == out[key]
    assert [c for ch in chunks for c in ch.get("tool_calls", ())] == out["tool_calls"]


def test_kimi_k3s_special_tokens_are_kept_for_its_tool_parser_alone(tagged: Path) -> None:
    # no reasoning parser: the tool parser's markers' pieces are kept in the text
    runner = TextGenerationRunner(tagged, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": "kimi_k3"})  # fmt: skip
    call = _k3_call("get_time", [("zone", "string", "cet")])
    pieces = ["Sure.", "<|open|>tools<|sep|>", call, "<|close|>tools<|sep|>"]
    _, out = generate(runner, "k3", pieces, stream=True)
    assert out["content"] == "Sure."
    assert [c["function"]["name"] for c in out["tool_calls"]] == ["get_time"]


@pytest.mark.parametrize(
    ("text", "answer"),
    [(f"{K3_RESPONSE[0]}Hi{K3_RESPONSE[1]}{K3_END}", "Hi"),
     (f"{K3_RESPONSE[0]}Hi{K3_RESPONSE[1]}<|open|>tools<|sep|>X<|close|>tools<|sep|>{K3_END}",
      "Hi<|open|>tools<|sep|>X<|close|>tools<|sep|>"),
     (f"Hi{K3_RESPONSE[1]}<|open|>tools<|sep|>X", "Hi<|open|>tools<|sep|>X"),  # bare
     ("<|open|>tools<|sep|>X", "<|open|>tools<|sep|>X")],
)  # fmt: skip
def test_kimi_k3s_answer_reads_on_into_its_tools_channel(text: str, answer: str) -> None:
    split = Reasoning("kimi_k3")
    assert split.answer(text) == answer
    grown = [split.answer(text[:end]) for end in range(len(text) + 1)]
    assert all(b.startswith(a) for a, b in itertools.pairwise(grown))  # only grows
    # others' wrapped answers end at their close
    assert Reasoning("ernie45").answer("<response>Hi</response><|open|>tools<|sep|>") == "Hi"


NS = "]<]minimax[>["


def _tag(key: str, body: str) -> str:
    return f"{NS}<{key}>{body}{NS}</{key}>"


def _m3(name: str, params: str) -> str:
    return f'{NS}<invoke name="{name}">{params}{NS}</invoke>\n'


def test_minimax_m3_values_are_typed_or_read_as_tags_as_vllm_does() -> None:
    types = {"f": {"n": "integer", "s": "string", "items": "array", "nul": "string"}}
    params = (_tag("n", "42") + _tag("s", "42") + _tag("free", "x y")
              + _tag("items", _tag("item", _tag("k", "a")) + _tag("item", _tag("k", "b")))
              + _tag("obj", _tag("x", "1") + _tag("x", "2") + _tag("y", "") + "tail")
              + _tag("nest", _tag("item", "1")) + _tag("nul", ""))  # fmt: skip
    text = f"Checking.{NS}<tool_call>\n" + _m3("f", params) + _m3("g", "") + f"{NS}</tool_call>"
    calls = _streams_as_read("minimax_m3", text, types)
    assert _args(calls) == [
        ("f", {"n": 42, "s": "42", "free": "x y", "items": [{"k": "a"}, {"k": "b"}],
               "obj": {"x": ["1", "2"], "y": "", "$text": "tail"},
               "nest": {"item": "1"},  # an <item> without an array schema: an object's
               "nul": ""}),
        ("g", {})]  # fmt: skip
    reader = CallReader(AUTO, "minimax_m3", types)
    reader.read(text, final=True)
    assert reader.content == "Checking."
    # a parameter cut by the end is not read, nor is a call without its name
    cut = f'{NS}<tool_call>{NS}<invoke name="f">{_tag("n", "1")}{NS}<s>abc'
    growing = CallReader(AUTO, "minimax_m3", types)
    growing.read(cut)
    assert growing.calls == []
    assert read_calls(AUTO, f"{NS}<tool_call>{NS}<invoke name=>{NS}</invoke>", "minimax_m3") is None
