"""More tool-call formats read as vLLM's parsers of the same name read them, past the
table-driven checks of ``test_generation_tools``: ``minicpm5``'s parameters and the calls
it refuses, ``dots``'s JSON fallback, ``kimi_k3``'s XTML channels; each read whole, and
streamed split at every character."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from batchfleet.schemas.tools import ToolUse
from batchfleet.worker.generation.tools import CallReader, read_calls
from test_generation_tool_formats import _args, _streams_as_read

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
