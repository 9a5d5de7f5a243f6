"""The tool-call formats read as vLLM's parsers of the same name read them, where they go
past the table-driven checks of ``test_generation_tools``: ``mimo``'s string values,
``hy_v3``'s and ``solar_open2``'s typing by the schema, ``lfm2``'s block and its echo,
``deepseek_v4``'s section, ``granite-20b-fc``'s JSON, ``functiongemma``'s ``<escape>``
values and ``gemma4``'s own syntax; each read whole, and streamed split at every character."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

pytest.importorskip("torch")
pytest.importorskip("llguidance")

from batchfleet.schemas.tools import ToolUse
from batchfleet.worker.generation import tool_formats, tools
from batchfleet.worker.generation.tools import CallReader, read_calls
from batchfleet.worker.runners.generation import TextGenerationRunner
from conftest import TINY_LM_OPTIONS
from test_generation_reasoning import compiled
from test_generation_runner import run
from test_generation_strict_calls import _accepts, _held
from test_generation_tool_chunks import _replay, _stream
from test_generation_tools import _literal, chat

AUTO = ToolUse("auto")
S = tool_formats.SOLAR
V32, V4 = tool_formats.V32, tool_formats.V4
"""Solar Open 2's markers (a call's start and end; an argument's start, value and end)."""


def _args(calls: list[dict[str, Any]] | None) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls or []]


def _streams_as_read(parser: str, text: str, types: Any = None) -> list[dict[str, Any]]:
    """The calls of ``text`` streamed a character at a time: they add up to the calls
    read whole (ids included), which are returned."""
    reader, steps = _stream(AUTO, parser, text, types)
    assert _replay([c for s in steps for c in s]) == dict(enumerate(reader.calls))
    whole = CallReader(AUTO, parser, types)
    whole.read(text, final=True)
    assert [c["function"] for c in reader.calls] == [c["function"] for c in whole.calls]
    assert reader.content == whole.content
    return reader.calls


def test_mimo_values_are_strings_as_written_whatever_the_schema() -> None:
    # vLLM's mimo: qwen3_coder's blocks, each value a string, newlines and all
    text = ("I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
            "<parameter=days>3</parameter>\n<parameter=opts>\n{\"a\": 1}\n</parameter>\n"
            "<parameter=none>null</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=get_time>\n</function>\n</tool_call>")  # fmt: skip
    types = {"get_weather": {"days": "integer", "opts": "object", "none": "string"}}
    calls = _streams_as_read("mimo", text, types)
    assert _args(calls) == [("get_weather", {"city": "Paris", "days": "3", "opts": '\n{"a": 1}\n',
                                             "none": "null"}), ("get_time", {})]  # fmt: skip
    reader = CallReader(AUTO, "mimo", types)
    reader.read(text, final=True)
    assert reader.content == "I'll look."
    # the same text read as qwen3_coder: typed
    assert _args(read_calls(AUTO, text, "qwen3_coder", types))[0][1]["days"] == 3


def test_hy_v3_values_are_typed_as_vllm_does() -> None:
    types = {"f": {"b": "boolean", "i": "integer", "n": "number", "m": "number", "x": "number",
                   "arr": "array", "obj": "object", "s": "string", "bad": "integer",
                   "flag": "boolean"}}  # fmt: skip
    params = {"b": "TRUE", "i": "-7", "n": "2.5", "m": "4", "x": "1e999", "arr": "[1, null]",
              "obj": '{"k": "v"}', "s": "[1]", "bad": "many", "flag": "yes", "free": "42",
              "sp": " a b "}  # fmt: skip
    body = "".join(
        f"\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>" for k, v in params.items()
    )
    text = (f"Checking.<tool_calls>\n<tool_call>f<tool_sep>{body}\n</tool_call>\n"
            "<tool_call>get_current_date<tool_sep>\n</tool_call>\n</tool_calls>")  # fmt: skip
    calls = _streams_as_read("hy_v3", text, types)
    assert [c["function"] for c in calls] == [  # (as text: 4 is not 4.0, nor 1 true)
        {"name": "f", "arguments": '{"b":true,"i":-7,"n":2.5,"m":4,"x":"1e999","arr":[1,null],'
                                   '"obj":{"k":"v"},"s":"[1]","bad":"many","flag":"yes",'
                                   '"free":"42","sp":" a b "}'},
        {"name": "get_current_date", "arguments": "{}"}]  # fmt: skip
    reader = CallReader(AUTO, "hy_v3", types)
    reader.read(text, final=True)
    assert reader.content == "Checking."
    # vLLM's tests: a zero-argument call inline, the calls' section only
    inline = "<tool_calls><tool_call>get_current_date<tool_sep></tool_call></tool_calls>"
    assert _args(read_calls(AUTO, inline, "hy_v3")) == [("get_current_date", {})]
    assert read_calls(AUTO, "<tool_call>f</tool_call>", "hy_v3") is None  # no <tool_sep>
    assert CallReader(AUTO, "hy_v3").content_so_far("Sure.<tool_cal") == "Sure."


def _solar(name: str, params: list[tuple[str, str]]) -> str:
    return f"{S[0]}{name}\n" + "".join(f"{S[2]}{k}{S[3]}{v}{S[4]}\n" for k, v in params) + S[1]


def test_solar_open2_values_are_coerced_as_vllm_does() -> None:
    types = {"do_all_types": {"s": "string", "i": "integer", "n": "number", "f": "number",
                              "b": "boolean", "c": "boolean", "arr": "array", "obj": "object",
                              "bad": "integer"}}  # fmt: skip
    params = [("s", "007"), ("i", "42"), ("n", "3.0"), ("f", "2.5"), ("b", "1"), ("c", "FALSE"),
              ("arr", "[1, 2]"), ("obj", '{"k": [true]}'), ("bad", "[3]"), ("s", "again"),
              ("free", '{"key": "value"}')]  # fmt: skip
    text = "Let me check." + _solar("do_all_types", params) + "\n" + _solar("get_time", [])
    calls = _streams_as_read("solar_open2", text, types)
    assert [c["function"] for c in calls] == [  # (as text: 3 is not 3.0, nor 1 true)
        {"name": "do_all_types", "arguments": '{"s":"007","i":42,"n":3,"f":2.5,"b":true,'
                                              '"c":false,"arr":[1,2],"obj":{"k":[true]},'
                                              '"bad":[3],"free":"{\\"key\\": \\"value\\"}"}'},
        {"name": "get_time", "arguments": "{}"}]  # fmt: skip
    # vLLM's tests: without a schema, values are strings; the name is its line's
    plain = _solar("search", [("query", "vLLM tutorial"), ("max_results", "5")])
    assert _args(read_calls(AUTO, plain, "solar_open2")) == [
        ("search", {"query": "vLLM tutorial", "max_results": "5"})]  # fmt: skip
    typed = read_calls(AUTO, plain, "solar_open2", {"search": {"max_results": "integer"}})
    assert _args(typed) == [("search", {"query": "vLLM tutorial", "max_results": 5})]
    # a call cut by the end is read only when whole (the value may go on), a block
    # without a name is none
    cut = f"Let me check.{S[0]}search\n{S[2]}query{S[3]}Seo"
    reader = CallReader(AUTO, "solar_open2")
    reader.read(cut)
    assert reader.calls == [] and reader.content_so_far(cut) == "Let me check."
    assert read_calls(AUTO, f"{S[0]}{S[2]}a{S[3]}1{S[4]}{S[1]}", "solar_open2") is None


def test_lfm2_reads_the_list_in_its_block_and_leaves_an_echo_out() -> None:
    start, end = "<|tool_call_start|>", "<|tool_call_end|>"
    text = (f'Sure.{start}[get_weather(location="Paris", days=2), get_time()]{end}'
            "It is sunny.")  # fmt: skip
    calls = _streams_as_read("lfm2", text)
    assert _args(calls) == [("get_weather", {"location": "Paris", "days": 2}), ("get_time", {})]
    # each call streams at its ")", before the list closes (vLLM's streams it so too)
    _, steps = _stream(AUTO, "lfm2", text)
    firsts = [k for k, s in enumerate(steps) for c in s if "id" in c]
    assert len(firsts) == 2 and firsts[1] < text.index("]")
    reader = CallReader(AUTO, "lfm2")
    reader.read(text, final=True)
    assert reader.content == "Sure.It is sunny."
    # the model's echo of the calls after the block, capped by another end: not content
    echo = f"{start}[f(a=1)]{end}[f(a=1)]{end} Done."
    reader = CallReader(AUTO, "lfm2")
    reader.read(echo, final=True)
    assert _args(reader.calls) == [("f", {"a": 1})] and reader.content == "Done."
    # a block the end cut is read once the text is whole (vLLM's), not while it may grow
    open_block = f"{start}[f(a=1)]"
    reader = CallReader(AUTO, "lfm2")
    reader.read(open_block)
    assert reader.calls == []
    assert _args(read_calls(AUTO, open_block, "lfm2")) == [("f", {"a": 1})]
    # not calls: a bare list (no block), a block that is not a list of calls
    for bad in ["[f(a=1)]", f"{start}f(a=1){end}", f"{start}[1, 2]{end}", f"{start}[]{end}"]:
        assert read_calls(AUTO, bad, "lfm2") is None, bad
    assert CallReader(AUTO, "lfm2").content_so_far("Sure.<|tool_call_st") == "Sure."


@pytest.mark.parametrize(("parser", "markup", "call"), [
    ("hy_v3", "<tool_calls><tool_call>get_weather<tool_sep><arg_key>unit</arg_key><arg_value>f"
              "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call></tool_calls>",
     '{"unit":"f","days":2}'),
    ("lfm2", '<|tool_call_start|>[get_weather(unit="f", days=2)]<|tool_call_end|>',
     '{"unit":"f","days":2}'),
    ("deepseek_v4", f'{V4[0]}{V32[2]} name="get_weather">{V32[4]} name="unit" string="true">f'
                    f'{V32[5]}{V32[4]} name="days" string="false">2{V32[5]}{V32[3]}{V4[1]}',
     '{"unit":"f","days":2}'),
    ("granite-20b-fc", '<function_call> {"name": "get_weather", "arguments": {"unit": "f", '
                       '"days": 2}}', '{"unit":"f","days":2}'),
    ("functiongemma", "<start_function_call>call:get_weather{unit:<escape>f<escape>,"
                      "days:<escape>2<escape>}<end_function_call>", '{"unit":"f","days":2}'),
    ("gemma4", '<|tool_call>call:get_weather{unit:<|"|>f<|"|>,days:2}<tool_call|>',
     '{"unit":"f","days":2}'),
])  # fmt: skip
def test_a_runner_reads_the_new_formats_calls(parser: str, markup: str, call: str,
                                              tiny_lm: Path) -> None:  # fmt: skip
    runner = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": parser})  # fmt: skip
    (out,) = run(runner, chat("x", structured_outputs={"regex": _literal(markup)},
                              max_new_tokens=300))["x"]  # fmt: skip
    assert out["text"] == markup and out["content"] == ""
    (made,) = out["tool_calls"]  # hy_v3: days an integer (its schema's type)
    assert made["function"] == {"name": "get_weather", "arguments": call}


def test_apertus_reads_keyed_calls_in_its_block() -> None:
    start, end = "<|tools_prefix|>", "<|tools_suffix|>"
    args = {"city": "Paris", "opts": {"days": [1, 2]}}
    text = f'I will check. {start}[{json.dumps({"get_weather": args})}, {{"get_time": {{}}}}]{end}'
    calls = _streams_as_read("apertus", text)
    assert _args(calls) == [("get_weather", args), ("get_time", {})]
    reader = CallReader(AUTO, "apertus")
    reader.read(text, final=True)
    assert reader.content == "I will check."
    # not calls: an object of two keys, arguments not an object, an array not after the
    # marker; an entry that is not a call is left out, the others read
    mixed = f'{start}[{{"a": {{}}, "b": {{}}}}, {{"c": 3}}, {{"d": {{"x": 1}}}}]{end}'
    assert _args(read_calls(AUTO, mixed, "apertus")) == [("d", {"x": 1})]
    assert read_calls(AUTO, '[{"a": {}}]', "apertus") is None
    assert CallReader(AUTO, "apertus").content_so_far("Sure.<|tools_pre") == "Sure."


def test_dots_values_are_typed_and_unknown_functions_left_out_as_vllm_does() -> None:
    types = {"search": {"q": "string", "n": "integer", "x": "number", "ok": "boolean",
                        "yes": "boolean", "opts": "object", "bad": "integer", "none": "string"},
             "get_time": {}}  # fmt: skip
    params = [("q", " weather in Shanghai\n"), ("n", "5"), ("x", "3.0"), ("ok", "1"),
              ("yes", "yes"), ("opts", '{"a": [1]}'), ("bad", "five"), ("none", "NULL"),
              ("free", "[1]")]  # fmt: skip
    body = "".join(f'\n<parameter name="{k}">{v}</parameter>' for k, v in params)
    text = ('Let me search.\n<dots_function_call>\n<invoke name="search">' + body +
            "\n</invoke>\n<invoke name='nope'>\n</invoke>\n<invoke name=get_time>\n</invoke>\n"
            "</dots_function_call>")  # fmt: skip
    calls = _streams_as_read("dots", text, types)
    assert [c["function"] for c in calls] == [  # (as text: 3 is not 3.0)
        {"name": "search", "arguments": '{"q":"weather in Shanghai","n":5,"x":3,"ok":true,'
                                        '"yes":false,"opts":{"a":[1]},"bad":"five",'
                                        '"none":null,"free":"[1]"}'},
        {"name": "get_time", "arguments": "{}"}]  # fmt: skip
    reader = CallReader(AUTO, "dots", types)
    reader.read(text, final=True)
    assert reader.content == "Let me search."
    # a function the request does not have is no call (nor any, without the request's)
    assert read_calls(AUTO, text, "dots") is None


def test_deepseek_v4_reads_v32s_blocks_in_its_own_section() -> None:
    # vLLM's deepseek_v4: V3.2's DSML invokes, in a tool_calls section (V3.2: function_calls)
    types = {"search": {"q": "string", "n": "integer", "opts": "object"}}
    params = [("q", "true", "  42 apples"), ("n", "false", "5"), ("opts", "false", '{"a": [1]}'),
              ("free", "false", "[true]"), ("s", "true", "[true]")]  # fmt: skip
    body = "".join(f'{V32[4]} name="{k}" string="{t}">{v}{V32[5]}\n' for k, t, v in params)
    text = (f'Let me search.\n\n{V4[0]}\n{V32[2]} name="search">\n{body}{V32[3]}\n'
            f'{V32[2]} name="get_time">\n{V32[3]}\n{V4[1]}\nDone.')  # fmt: skip
    calls = _streams_as_read("deepseek_v4", text, types)
    assert _args(calls) == [("search", {"q": "  42 apples", "n": 5, "opts": {"a": [1]},
                                        "free": [True], "s": "[true]"}), ("get_time", {})]  # fmt: skip
    reader = CallReader(AUTO, "deepseek_v4", types)
    reader.read(text, final=True)
    assert reader.content == "Let me search.\n\n\nDone."  # the section's markers: markup
    assert CallReader(AUTO, "deepseek_v4").content_so_far(f"Sure.{V4[0][:5]}") == "Sure."
    # held strict as V3.2's, in V4's section
    assert tools.MARKERS["deepseek_v4"] == V4


def test_granite_20b_fc_reads_a_json_call_after_each_marker(tmp_path: Path) -> None:
    # vLLM's tests: each <function_call> then one JSON object {"name", "arguments"}
    args = {"string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": True,
            "null_field": None, "array_field": ["a", "b"], "object_field": {"nested": "v"},
            "quoted": 'He said "hello"', "path": "C:\\Users\\file.txt", "unicode": "🎉"}  # fmt: skip
    call = json.dumps({"name": "test", "arguments": args}, indent=2)
    text = f'Let me check.\n<function_call> {call}\n<function_call> {{"name": "refresh", "arguments": {{}}}}'

    calls = _streams_as_read("granite-20b-fc", text)
    assert _args(calls) == [("test", args), ("refresh", {})]
    reader = CallReader(AUTO, "granite-20b-fc")
    reader.read(text, final=True)
    assert reader.content == "Let me check."
    for bad in ['<function_call> {"name": "func", "arguments": {',
                '<function_call> [{"name": "func", "arguments": {}}]',
                '{"name": "func", "arguments": {}}', '<function_call> {"name": 123}']:  # fmt: skip
        assert read_calls(AUTO, bad, "granite-20b-fc") is None, bad
    assert CallReader(AUTO, "granite-20b-fc").content_so_far("Sure.<function_") == "Sure."
    # strict: a call after the marker follows its function's schema
    runner, strict = _held(tmp_path, "granite-20b-fc", ())
    good = '<function_call> {"name": "get_weather", "arguments": {"unit": "c", "days": 3}}'
    assert _accepts(runner, strict, "Plain.") and _accepts(runner, strict, f"Sure. {good}")
    assert not _accepts(runner, strict, f"Sure. {good.replace('3}', '9}')}")
    assert not _accepts(runner, strict, "<function_call> sunny")


def test_functiongemma_reads_escaped_values_as_vllm_does() -> None:
    start, end = "<start_function_call>", "<end_function_call>"
    text = (f"Let me check the weather for you. {start}call:get_weather{{location:<escape>San "
            f"Francisco, CA<escape>,count:<escape>42<escape>,enabled:<escape>true<escape>,"
            f"opts:<escape>{{\"a\": [1]}}<escape>,zip:<escape>007<escape>,note:<escape>a}}"
            f"<escape>}}{end}{start}call:get_time{{}}{end} Done.")  # fmt: skip
    calls = _streams_as_read("functiongemma", text)
    assert _args(calls) == [("get_weather", {"location": "San Francisco, CA", "count": 42,
                                             "enabled": True, "opts": {"a": [1]}, "zip": "007",
                                             "note": "a}"}), ("get_time", {})]  # fmt: skip
    reader = CallReader(AUTO, "functiongemma")
    reader.read(text, final=True)
    assert reader.content == "Let me check the weather for you.  Done."
    # vLLM's streaming test: parameters with no commas between them
    bare = f"{start}call:get_weather{{city:<escape>NYC<escape>unit:<escape>celsius<escape>}}{end}"
    assert _args(_streams_as_read("functiongemma", bare)) == [
        ("get_weather", {"city": "NYC", "unit": "celsius"})]  # fmt: skip
    # a value not in <escape> is not read (vLLM's); a block cut by the end is read once the
    # text is whole; a name not of word characters is no call
    milk = f"{start}call:add_item{{name:<escape>milk<escape>,quantity:2}}{end}"
    assert _args(read_calls(AUTO, milk, "functiongemma")) == [("add_item", {"name": "milk"})]
    cut = f"{start}call:f{{a:<escape>1<escape>"
    reader = CallReader(AUTO, "functiongemma")
    reader.read(cut)
    assert reader.calls == [] and _args(read_calls(AUTO, cut, "functiongemma")) == [("f", {"a": 1})]
    assert read_calls(AUTO, f"{start}call:ns.f{{}}{end}", "functiongemma") is None
    assert read_calls(AUTO, "call:f{a:<escape>1<escape>}", "functiongemma") is None
    assert CallReader(AUTO, "functiongemma").content_so_far("Sure.<start_func") == "Sure."


G4, Q = tool_formats.GEMMA4, tool_formats.GEMMA4[2]
"""Gemma 4's markers (a call's start and end) and its strings' delimiter."""


def test_gemma4_reads_its_own_value_syntax_as_vllm_does() -> None:
    args = (f"location:{Q}Paris, France{Q},n:42,x:2.5,neg:-3,ok:true,no:false,z:null,w:None,"
            f"bare: hi there ,e:1e5,big:1.5e999,nested:{{inner:{Q}a}}b{Q},c:[1,{Q}x{Q}]}},"
            f"arr:[{{k:1}},[2,3],true],{Q}quoted{Q}:1")  # fmt: skip
    calls_ = f"{G4[0]}call:get_weather{{{args}}}{G4[1]}{G4[0]}call:ns.get-time{{}}{G4[1]}"
    text = f"Let me check. {calls_}"
    calls = _streams_as_read("gemma4", text)
    assert _args(calls) == [("get_weather", {
        "location": "Paris, France", "n": 42, "x": 2.5, "neg": -3, "ok": True, "no": False,
        "z": None, "w": None, "bare": "hi there", "e": "1e5", "big": "1.5e999",
        "nested": {"inner": "a}b", "c": [1, "x"]}, "arr": [{"k": 1}, [2, 3], True],
        "quoted": 1}), ("ns.get-time", {})]  # fmt: skip
    reader = CallReader(AUTO, "gemma4")
    reader.read(text, final=True)
    assert reader.content == "Let me check."
    # each pair streams once ended: a string at its closing delimiter, a bare value at the
    # comma after it, an object or array once closed
    _, steps = _stream(AUTO, "gemma4", text)
    partial = "".join(c["function"]["arguments"] for s in steps[: text.index(",n:42") + 1]
                      for c in s if c.get("index") == 0)  # fmt: skip
    assert partial == '{"location":"Paris, France"'
    # vLLM's reading of what the end cut: an unclosed string, object or array read as far as
    # it goes (a bare value at an object's end left out), in a block whose "}" closes it
    # a key written twice: its last value, in its first place (vLLM's dict)
    twice = f"{G4[0]}call:f{{n:1,m:2,n:3}}{G4[1]}"
    assert read_calls(AUTO, twice, "gemma4")[0]["function"]["arguments"] == '{"n":3,"m":2}'
    cut = f"{G4[0]}call:f{{s:{Q}ab,c}}{G4[1]}"
    assert _args(read_calls(AUTO, cut, "gemma4")) == [("f", {"s": "ab,c"})]
    cut = f"{G4[0]}call:f{{o:{{a:1,b:2}}{G4[1]}"
    assert _args(read_calls(AUTO, cut, "gemma4")) == [("f", {"o": {"a": 1}})]
    # a block the end cuts after its "}" is read once the text is whole (as every block
    # format's here; vLLM's: none), not while it may grow
    reader = CallReader(AUTO, "gemma4")
    reader.read(f"{G4[0]}call:f{{a:1}}")
    assert reader.calls == [] and _args(read_calls(AUTO, f"{G4[0]}call:f{{a:1}}", "gemma4")) == [
        ("f", {"a": 1})]  # fmt: skip
    # not calls: no "}" before the end marker, no "call:" right after the start, no block
    for bad in [f"{G4[0]}call:f{{a:1{G4[1]}", f"{G4[0]} call:f{{}}{G4[1]}", "call:f{a:1}"]:
        assert read_calls(AUTO, bad, "gemma4") is None, bad
    assert CallReader(AUTO, "gemma4").content_so_far("Sure.<|tool_") == "Sure."


@pytest.mark.parametrize("special", [False, True])
def test_gemma4_strict_calls_follow_the_schema_in_its_syntax(special: bool, tmp_path: Path) -> None:
    runner, strict = _held(tmp_path, "gemma4", (*G4, Q) if special else ())
    weather = f"{G4[0]}call:get_weather{{unit:{Q}c{Q},days:3}}{G4[1]}"
    assert _accepts(runner, strict, "Plain.") and _accepts(runner, strict, f"Sure. {weather} ok")
    assert _args(read_calls(AUTO, weather, "gemma4")) == [("get_weather", {"unit": "c", "days": 3})]
    free = f"{G4[0]}call:get_time{{zone:{Q}a, b}}{Q},n:[1,{{x:true}}]}}{G4[1]}"
    assert _accepts(runner, strict, free)  # not strict: any pairs
    for bad in (f"unit:{Q}k{Q},days:3", f"unit:{Q}c{Q},days:9", f"days:3,unit:{Q}c{Q}",
                f"unit:{Q}c{Q}", f"unit:{Q}c{Q},days:{Q}3{Q}", f"unit:{Q}c{Q}days:3"):  # fmt: skip
        assert not _accepts(runner, strict, f"{G4[0]}call:get_weather{{{bad}}}{G4[1]}"), bad
    # optional parameters may each be left out, the commas between those written only
    opt = {"type": "function", "function": {"name": "opt", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                         "c": {"type": "boolean"}}}}}  # fmt: skip
    (prep,) = runner.prepare_many([chat("o", tools=[opt])])
    held = compiled(prep)
    for args in ("", f"b:{Q}x{Q}", "a:1,c:true", f"a:1,b:{Q}x{Q},c:false", "c:true"):
        assert _accepts(runner, held, f"{G4[0]}call:opt{{{args}}}{G4[1]}"), args
    for args in (f"b:{Q}x{Q},a:1", f",b:{Q}x{Q}", "a:1,", "a:1c:true", "a:1,,c:true"):
        assert not _accepts(runner, held, f"{G4[0]}call:opt{{{args}}}{G4[1]}"), args
