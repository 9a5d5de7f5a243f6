"""Six parsers where they read past their tags as vLLM's parsers of the same name do: the
values a function's JSON Schema types (``minimax_m3``'s nested tags, ``inkling``'s
coercion), the parameters it lacks (``minicpm5``), the section calls must be in
(``hy_v4``), the channels the tool parser alone unwraps (``kimi_k3``) and the reasoning
it alone streams (``muse_glimmer``, ``inkling``). Each text is read whole and streamed a
character at a time (a marker whole where the model writes it so); the pieces add up to
the result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

pytest.importorskip("torch")

from batchfleet.schemas.tools import Tool, ToolUse
from batchfleet.worker.generation import blocks, hy_v4, inkling, muse_glimmer
from batchfleet.worker.generation.split import OutputSplit
from batchfleet.worker.generation.tagged_args import Types, param_types
from batchfleet.worker.generation.tool_chunks import CallChunks
from batchfleet.worker.generation.tools import CallReader, read_calls
from batchfleet.worker.runners.generation import TextGenerationRunner
from conftest import TINY_LM_OPTIONS
from test_generation_blocks import TEMPLATE, _tokens
from test_generation_cohere import _added, _stream
from test_generation_reasoning import generate
from test_generation_reasoning_parsers import K3_END, K3_RESPONSE, K3_THINK, SPECIALS
from test_generation_tool_formats import _args, _streams_as_read
from tiny_models import make_causal_lm

AUTO = ToolUse("auto")


def _types(name: str, parameters: dict[str, Any]) -> Types:
    """The types a request with one function of these ``parameters`` gives its parser."""
    return param_types([Tool.model_validate({"type": "function", "function": {
        "name": name, "parameters": {"type": "object", **parameters}}})])  # fmt: skip


def _split(parser: str, types: Types, *, reasoning: bool = False,
           channels: bool = False) -> OutputSplit:  # fmt: skip
    """A text's split with tools (its format's, where it has one), as the runner's."""
    fmt = blocks.FORMATS.get(parser)
    split = OutputSplit(blocks.BlocksReasoning(parser) if reasoning else None, None, False,
                        blocks=fmt, channels=channels)  # fmt: skip
    split.calls = CallReader(AUTO, parser, types)
    split.chunks = CallChunks(split.calls, AUTO, parser, types)
    return split


def _whole_and_streamed(parser: str, text: str, types: Types, **kw: bool) -> dict[str, Any]:
    """``text``'s result, read whole; streamed a character at a time and as a model writes
    it, the same, its deltas' pieces adding up to it (calls and their chunks too)."""
    got = _split(parser, types, **kw).result(text)
    for pieces in (list(text), _tokens(text)):
        deltas, whole = _stream(_split(parser, types, **kw), pieces)
        assert {**whole, "tool_calls": _args(whole.get("tool_calls"))} == {
            **got, "tool_calls": _args(got.get("tool_calls"))}  # fmt: skip
        for key in ("reasoning_content", "content"):
            assert "".join(d.get(key, "") for d in deltas) == whole.get(key, "")
        made = whole.get("tool_calls", [])
        assert [c for d in deltas for c in d.get("tool_calls", ())] == made
        ids = {c["id"] for c in made}  # (a call begun, then none, is left out of the result)
        assert [c for c in _added(deltas).values() if c["id"] in ids] == made
    return got


# minimax_m3: a value written as tags is typed by its own schema, however deep

NS = "]<]minimax[>["


def _tag(key: str, body: str) -> str:
    return f"{NS}<{key}>{body}{NS}</{key}>"


M3_TYPES = _types("f", {"properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "integer"}, "on": {"type": "boolean"}}}},
    "cfg": {"type": "object", "properties": {
        "ratio": {"type": "number"}, "ids": {"type": "array", "items": {"type": "integer"}},
        "code": {"type": "string"}, "opt": {"type": ["integer", "null"]},
        "meta": {"type": "object"}, "tags": {"type": "array"}}},
    "free": {"type": "object"}}})  # fmt: skip


def test_minimax_m3_types_nested_values_by_their_schemas() -> None:
    params = (_tag("items", _tag("item", _tag("k", "1") + _tag("on", "yes"))
                            + _tag("item", _tag("k", "x")))
              + _tag("cfg", _tag("ratio", "2.5") + _tag("ids", _tag("item", "3") + _tag("item", "4") + "5")
                     + _tag("code", "007") + _tag("opt", "null") + _tag("meta", "") + _tag("tags", ""))
              + _tag("free", _tag("n", "5")))  # fmt: skip
    text = f'Sure.{NS}<tool_call>\n{NS}<invoke name="f">{params}{NS}</invoke>\n{NS}</tool_call>'
    calls = _streams_as_read("minimax_m3", text, M3_TYPES)
    assert _args(calls) == [("f", {
        "items": [{"k": 1, "on": True}, {"k": "x"}],  # not an integer: as written
        "cfg": {"ratio": 2.5, "ids": [3, 4, 5], "code": "007", "opt": None, "meta": {}, "tags": []},
        "free": {"n": "5"},  # no schema for n: as written
    })]  # fmt: skip
    got = _whole_and_streamed("minimax_m3", text, M3_TYPES)
    assert got["content"] == "Sure." and _args(got["tool_calls"]) == _args(calls)


M3_CHECKED = _types("f", {"properties": {
    "n": {"type": ["integer", "string"], "minimum": 10},  # 5 is too small: the string
    "m": {"type": ["integer", "string"], "minimum": 10},  # 50 is allowed: the integer
    "code": {"anyOf": [{"type": "integer", "maximum": 3}, {"type": "string", "pattern": "^[0-9]+$"}]},
    "on": {"type": "boolean"}, "ratio": {"type": "number"},
    "word": {"type": "string"}, "raw": {"type": "string"},
    "bad": {"type": ["integer", "string"], "minimum": "ten"},  # an invalid schema
    "rows": {"type": "array", "items": {"type": ["integer", "string"], "maximum": 9}},
}})  # fmt: skip


def test_minimax_m3_reads_each_value_as_its_whole_schema_allows() -> None:
    # vLLM's M3 grammar converts a value by each of its schema's kinds and keeps the most
    # confident reading, one jsonschema validates beating the others (not only its kind)
    params = (_tag("n", "5") + _tag("m", "50") + _tag("code", "7") + _tag("on", "on")
              + _tag("ratio", "3.0") + _tag("word", "null") + _tag("raw", "\nline\n")
              + _tag("bad", "5") + _tag("rows", _tag("item", "4") + _tag("item", "12")))  # fmt: skip
    text = f'{NS}<tool_call>\n{NS}<invoke name="f">{params}{NS}</invoke>\n{NS}</tool_call>'
    calls = _streams_as_read("minimax_m3", text, M3_CHECKED)
    assert _args(calls) == [("f", {
        "n": "5", "m": 50, "code": "7", "on": True, "ratio": 3, "word": "null",
        "raw": "\nline\n", "bad": 5, "rows": [4, "12"],
    })]  # fmt: skip
    got = _whole_and_streamed("minimax_m3", text, M3_CHECKED)
    assert _args(got["tool_calls"]) == _args(calls)


# minicpm5: a parameter the function's schema lacks is left out

CPM_TYPES = _types("f", {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]})  # fmt: skip


def _cpm(params: str) -> str:
    return f'Sure.\n<function name="f">\n{params}</function>'


def test_minicpm5_drops_the_parameters_its_schema_lacks() -> None:
    text = _cpm('<param name="city">Paris</param>\n<param name="extra">1</param>\n'
                '<param name="extra">2</param>\n'  # twice, but left out: no fault
                "<param name=\"arguments\">{'days': '3', 'junk': 1}</param>\n")  # fmt: skip
    calls = _streams_as_read("minicpm5", text, CPM_TYPES)
    assert _args(calls) == [("f", {"city": "Paris", "days": 3})]
    got = _whole_and_streamed("minicpm5", text, CPM_TYPES)
    assert got["content"] == "Sure." and _args(got["tool_calls"]) == _args(calls)
    # without a schema's properties, all are kept (and one written twice is a fault)
    kept = text.replace('<param name="extra">2</param>\n', "")
    assert _args(read_calls(AUTO, kept, "minicpm5", {"f": {}})) == [
        ("f", {"city": "Paris", "extra": 1, "arguments": {"days": "3", "junk": 1}})]  # fmt: skip
    assert read_calls(AUTO, text, "minicpm5", {"f": {}}) is None


@pytest.mark.parametrize(
    "params",
    ['<param name="days">3</param>',  # the required city missing
     '<param name="city">a</param><param name="properties">[1]</param>',  # not an object
     '<param name="city">a</param><param name="arguments">{"junk": 1}</param>',  # none known
     '<param name="city">a</param><param name="arguments">{"city": "b"}</param>'],  # twice
)  # fmt: skip
def test_a_minicpm5_call_its_schema_refuses_is_none(params: str) -> None:
    text = _cpm(params)
    assert read_calls(AUTO, text, "minicpm5", CPM_TYPES) is None
    got = _whole_and_streamed("minicpm5", text, CPM_TYPES)
    assert "tool_calls" not in got and got["content"] == text


# minicpm5: the names it writes for tau2-bench's telecom functions, renamed as vLLM's

TELECOM = {
    **_types("get_customer_by_phone", {"properties": {"phone_number": {"type": "string"}},
                                       "required": ["phone_number"]}),
    **_types("get_customer_by_name", {"properties": {
        "full_name": {"type": "string"}, "date_of_birth": {"type": "string"}},
        "required": ["full_name", "date_of_birth"]}),
    **_types("get_details_by_id", {"properties": {"id": {"type": "string"}}, "required": ["id"]}),
    **_types("toggle_roaming", {"properties": {
        "line_id": {"type": "string"}, "enabled": {"type": "boolean"}}}),
    **_types("refuel_data", {"properties": {
        "customer_id": {"type": "string"}, "line_id": {"type": "string"},
        "amount_gb": {"type": "number"}}}),
}  # fmt: skip


def _cpm_call(function: str, /, **params: str) -> str:
    return f'<function name="{function}">' + "".join(
        f'<param name="{k}">{v}</param>' for k, v in params.items()) + "</function>"  # fmt: skip


def test_minicpm5_renames_the_telecom_calls_it_writes_by_other_names() -> None:
    text = ("Let me check.\n" + _cpm_call("get_details_by_phone", phone="+1 555 0100")
            + _cpm_call("enable_roaming", line_id="L1") + _cpm_call("disable_roaming", id="L2")
            + _cpm_call("get_line_status", line_id="L3", extra="x")
            + _cpm_call("get_plan_details", plan_id="", id="P9")  # an empty one: the next name
            + _cpm_call("add_data_to_line", customer_id="C1", id="L4", gb="2")
            + _cpm_call("get_details_by_name", name="Ann Lee", dob="1990-01-02"))  # fmt: skip
    calls = _streams_as_read("minicpm5", text, TELECOM)
    assert _args(calls) == [
        ("get_customer_by_phone", {"phone_number": "+1 555 0100"}),
        ("toggle_roaming", {"line_id": "L1", "enabled": True}),
        ("toggle_roaming", {"line_id": "L2", "enabled": False}),
        ("get_details_by_id", {"id": "L3"}),
        ("get_details_by_id", {"id": "P9"}),
        ("refuel_data", {"customer_id": "C1", "line_id": "L4", "amount_gb": 2}),  # read untyped
        ("get_customer_by_name", {"full_name": "Ann Lee", "date_of_birth": "1990-01-02",
                                  "dob": "1990-01-02"}),
    ]  # fmt: skip
    got = _whole_and_streamed("minicpm5", text, TELECOM)
    assert got["content"] == "Let me check." and _args(got["tool_calls"]) == _args(calls)


@pytest.mark.parametrize(
    "text",
    [_cpm_call("get_details_by_phone", number="1"),  # no phone: not renamed
     _cpm_call("get_details_by_name", name="Ann"),  # renamed, but no date_of_birth (required)
     '<function name="get_line_details"><param name="line_id">L1</param><param>1</param></function>',
     '<function name="get_line_details"><param name="id">L1</param><param name="id">L2</param></function>',
     _cpm_call("lookup_line", line_id="L1")],  # no such name
)  # fmt: skip
def test_a_minicpm5_call_it_cannot_rename_is_none(text: str) -> None:
    # (a parameter without its name, or written twice, is a fault before any renaming)
    assert read_calls(AUTO, text, "minicpm5", TELECOM) is None
    got = _whole_and_streamed("minicpm5", text, TELECOM)
    assert "tool_calls" not in got and got["content"] == text


def test_minicpm5_keeps_a_name_the_request_has() -> None:
    # the request has get_details_by_phone itself: its call, as written
    types = {
        **TELECOM,
        **_types("get_details_by_phone", {"properties": {"phone": {"type": "string"}}}),
    }
    text = _cpm_call("get_details_by_phone", phone="555")
    assert _args(read_calls(AUTO, text, "minicpm5", types)) == [
        ("get_details_by_phone", {"phone": "555"})
    ]
    # and without the function a name stands for, it is none
    rest = {k: v for k, v in TELECOM.items() if k != "get_customer_by_phone"}
    assert read_calls(AUTO, text, "minicpm5", rest) is None


# minicpm5: its text cleaned up as vLLM's tool parser cleans it (its tests' texts)

WEATHER = _types("get_weather", {"properties": {"city": {"type": "string"},
                                                "date": {"type": "string"}}, "required": ["city"]})  # fmt: skip
SHANGHAI = [("get_weather", {"city": "上海", "date": "2024-06-27"})]
_G = "\u0120"  # Ġ: a space, as a byte-level BPE tokenizer's vocabulary writes it


@pytest.mark.parametrize("head", [f"<function{_G}name=", "<functionname="])
@pytest.mark.parametrize("param", [f"<param{_G}name=", "<paramname="])
def test_minicpm5_reads_tags_spaced_by_the_tokenizer_or_run_together(head: str,
                                                                     param: str) -> None:  # fmt: skip
    text = (f'{head}"get_weather">{param}"city">上海</param>{param}"date">2024-06-27</param>'
            "</function>\n")  # fmt: skip
    assert _args(read_calls(AUTO, text, "minicpm5", WEATHER)) == SHANGHAI
    got = _whole_and_streamed("minicpm5", text, WEATHER)
    assert _args(got["tool_calls"]) == SHANGHAI and got["content"] == ""
    # only where its tool parser reads the text: tool_choice required asks for JSON
    assert CallReader(ToolUse("required"), "minicpm5", WEATHER).clean(text, True) == text


@pytest.mark.parametrize(
    ("text", "content"),
    [(f"\u010aFirst,{_G}I{_G}need{_G}to{_G}check{_G}the{_G}weather.",
      "First, I need to check the weather."),
     # (a tag run together held back while written: the pieces add up)
     ('Write <paramname="x">, or <functionname="nope"></function>',
      'Write <param name="x">, or <function name="nope"></function>')],
)  # fmt: skip
def test_minicpm5_content_is_cleaned_up_too(text: str, content: str) -> None:
    assert _whole_and_streamed("minicpm5", text, WEATHER) == {"content": content}


SUNNY = "<think>\nThe user wants the weather.\n</think>\n\nIt is sunny."
PARIS = '<function name="get_weather"><param name="city">Paris</param></function>'


@pytest.mark.parametrize(
    ("text", "content", "streamed"),
    [(SUNNY, "It is sunny.", SUNNY),
     # the last </think>, wherever it stands and whether or not the text opened it
     ("Hm.</think>It is sunny.", "It is sunny.", "Hm.</think>It is sunny."),
     ("<think>a</think>b</think>\n c", "c", "<think>a</think>b</think>\n c"),
     # a block that is no call (get_weather needs its city) stays content, thinking too
     ('<think>Call it? <function name="get_weather"></function></think>\nSure.\n' + PARIS,
      "Sure.", '<think>Call it? <function name="get_weather"></function></think>\nSure.'),
     # nothing after it, or none: the whole text
     ("<think>only thinking</think>", "<think>only thinking</think>",
      "<think>only thinking</think>"),
     ("<think>cut short", "<think>cut short", "<think>cut short")],
)  # fmt: skip
def test_minicpm5_content_is_what_follows_the_last_think_end_unless_streamed(
    text: str, content: str, streamed: str
) -> None:
    """vLLM's tool parser strips the thinking from the whole text's content, up to its
    last ``</think>``; its stream strips nothing, and neither does this one's."""
    calls = [("get_weather", {"city": "Paris"})] if PARIS in text else []
    got = _split("minicpm5", WEATHER).result(text)
    assert (got["content"], _args(got.get("tool_calls"))) == (content, calls)
    for pieces in (list(text), _tokens(text)):
        deltas, whole = _stream(_split("minicpm5", WEATHER), pieces)
        assert (whole["content"], _args(whole.get("tool_calls"))) == (content, calls)
        assert "".join(d["content"] for d in deltas) == streamed
        assert [c for d in deltas for c in d.get("tool_calls", ())] == whole.get("tool_calls", [])
    # streamed as it comes, not held to the end
    deltas, _ = _stream(_split("minicpm5", WEATHER), list(text))
    if text == SUNNY:
        assert "".join(d["content"] for d in deltas[:-1]) == SUNNY


# hy_v4: calls only in the first <tool_calls> section, once closed, all or none

HY = hy_v4.tags("")
SEC, SEC_, CALL, CALL_, K, K_, V, V_ = HY
HY_TYPES = _types("f", {"properties": {"n": {"type": "integer"}}})


def _hy(name: str, *pairs: tuple[str, str]) -> str:
    return CALL + name + "".join(f"{K}{k}{K_}{V}{v}{V_}" for k, v in pairs) + CALL_


def test_hy_v4_reads_calls_in_its_section_only() -> None:
    inside = SEC + _hy("f", ("n", "2")) + _hy("g") + SEC_
    text = "Hi." + _hy("f", ("n", "1")) + " then " + inside + " after"
    calls = _streams_as_read("hy_v4", text, HY_TYPES)
    assert _args(calls) == [("f", {"n": 2}), ("g", {})]  # not the block before the section
    got = _whole_and_streamed("hy_v4", text, HY_TYPES)
    assert _args(got["tool_calls"]) == _args(calls)
    assert got["content"] == "Hi." + _hy("f", ("n", "1")) + " then"  # the text after: none


@pytest.mark.parametrize(
    "text",
    [_hy("f", ("n", "1")),  # no section
     SEC + _hy("f", ("n", "1")),  # not closed
     SEC + _hy("f", ("n", "1")) + _hy("") + SEC_,  # a block without a name
     SEC + _hy("f", ("n", "1")) + CALL + "g" + SEC_,  # a block not closed
     SEC + CALL + f"f{K}n{K_}{V}1{V_} stray" + CALL_ + SEC_,  # text beside the pairs
     SEC + CALL + f"f{K}n{K_}{V}1" + CALL_ + SEC_],  # a value not closed
)  # fmt: skip
def test_a_hy_v4_section_written_badly_makes_no_call(text: str) -> None:
    assert read_calls(AUTO, text, "hy_v4", HY_TYPES) is None
    got = _whole_and_streamed("hy_v4", text, HY_TYPES)
    assert "tool_calls" not in got and got["content"] == text.strip()


# kimi_k3: its tool parser alone unwraps the response channel

K3_CALL = ('<|open|>call tool="f" index="1"<|sep|><|open|>argument key="n" type="integer"<|sep|>'
           "1<|close|>argument<|sep|><|close|>call<|sep|>")  # fmt: skip
K3_TOOLS = f"<|open|>tools<|sep|>{K3_CALL}<|close|>tools<|sep|>"


@pytest.mark.parametrize(
    ("text", "content", "called"),
    [(f"{K3_THINK[0]}hm{K3_THINK[1]}{K3_RESPONSE[0]}I will check.{K3_RESPONSE[1]}{K3_TOOLS}"
      f"{K3_END}", "I will check.", True),
     (f"I will check.{K3_RESPONSE[1]}{K3_TOOLS}{K3_END}", "I will check.", True),  # bare
     (f"Hi {K3_TOOLS}", "Hi", True),
     (f"{K3_RESPONSE[0]}Only words.{K3_RESPONSE[1]}{K3_END}", "Only words.", False),
     (f"{K3_THINK[0]}hm{K3_THINK[1]}{K3_TOOLS}", f"{K3_THINK[0]}hm{K3_THINK[1]}", True),
     ("Plain text.", "Plain text.", False)],
)  # fmt: skip
def test_kimi_k3s_tool_parser_alone_unwraps_the_response(text: str, content: str,
                                                          called: bool) -> None:  # fmt: skip
    got = _whole_and_streamed("kimi_k3", text, {}, channels=True)
    assert got["content"] == content
    assert _args(got.get("tool_calls")) == ([("f", {"n": 1})] if called else [])


@pytest.fixture(scope="module")
def tagged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("tiny-k3-alone"), specials=SPECIALS)


def test_a_runner_with_kimi_k3s_tool_parser_alone_unwraps_its_channels(tagged: Path) -> None:
    runner = TextGenerationRunner(tagged, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": "kimi_k3"})  # fmt: skip
    pieces = [K3_THINK[0], "hm", K3_THINK[1], K3_RESPONSE[0], "I will", " check.",
              K3_RESPONSE[1], "<|open|>tools<|sep|>", K3_CALL, "<|close|>tools<|sep|>", K3_END]  # fmt: skip
    for stream in (True, False):
        chunks, out = generate(runner, f"k3{stream}", pieces, stream=stream)
        assert out["content"] == "I will check." and "reasoning_content" not in out
        assert _args(out["tool_calls"]) == [("f", {"n": 1})]
        if stream:
            assert "".join(c["content"] for c in chunks) == out["content"]


# inkling: its values coerced to the function's schema, streamed as they settle

INK_TYPES = _types("f", {"properties": {
    "n": {"type": "integer"}, "s": {"type": "string"}, "x": {"type": "number"},
    "o": {"type": "object", "properties": {"b": {"type": "boolean"}}},
    "l": {"type": "array", "items": {"type": "integer"}}, "free": {}}})  # fmt: skip
INK_CALL = ('{"name": "f", "args": {"n": "5", "s": 7, "x": 2.0, "o": {"b": "true"}, '
            '"l": ["1", 2], "free": 3, "more": "6"}}')  # fmt: skip
INK_ARGS = {"n": 5, "s": "7", "x": 2, "o": {"b": True}, "l": [1, 2], "free": "3", "more": "6"}


def test_inkling_values_are_coerced_to_their_schema() -> None:
    text = f"{inkling.TOOL_JSON}{INK_CALL}{inkling.END}{inkling.MESSAGE_MODEL}{inkling.TEXT}ok"
    got = _whole_and_streamed("inkling", text, INK_TYPES)
    assert _args(got["tool_calls"]) == [("f", INK_ARGS)] and got["content"] == "ok"
    # streamed a member at a time, once the next "," or "}" settles it
    deltas, _ = _stream(_split("inkling", INK_TYPES), list(text))
    pieces = [c["function"]["arguments"] for d in deltas for c in d.get("tool_call_chunks", ())]
    assert pieces[:4] == ["", "{", '"n":5', ',"s":"7"']
    # a function the request lacks, or without a schema: as written
    other = text.replace('"f"', '"g"')
    assert _args(read_calls(AUTO, other, "inkling", INK_TYPES))[0][1]["n"] == "5"


# muse_glimmer (and inkling): the tool parser alone streams the reasoning blocks (one
# after the other), a whole result has none; the content and calls are the same

MUSE_TEXT = (" to=self<|message|>Let me think.<|eom|><|start|>assistant to=f<|message|>"
             '<atem:invoke name="f"><atem:parameter name="n">1</atem:parameter></atem:invoke>'
             "<|eom|><|start|>assistant to=self<|message|>Still.<|eom|>"
             "<|start|>assistant to=user<|message|>Done.<|eot|>")  # fmt: skip
INK_TEXT = (f"{inkling.THINKING}Let me think.{inkling.END}{inkling.MESSAGE_MODEL}"
            f'{inkling.TOOL_JSON}{{"name": "f", "args": {{"n": 1}}}}{inkling.END}'
            f"{inkling.MESSAGE_MODEL}{inkling.THINKING}Still. {inkling.END}"
            f"{inkling.MESSAGE_MODEL}{inkling.TEXT}Done.{inkling.END}")  # fmt: skip


@pytest.fixture(scope="module")
def blocky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    specials = (*inkling.TOKENS, *muse_glimmer.TOKENS, "<|end|>")
    return make_causal_lm(tmp_path_factory.mktemp("tiny-blocks-alone"), specials=specials,
                          eos_tokens=("<|end|>",), template=TEMPLATE)  # fmt: skip


@pytest.mark.parametrize(("parser", "text"), [("muse_glimmer", MUSE_TEXT), ("inkling", INK_TEXT)])
def test_a_block_tool_parser_alone_streams_the_reasoning(blocky: Path, parser: str,
                                                         text: str) -> None:  # fmt: skip
    runner = TextGenerationRunner(blocky, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": parser})  # fmt: skip
    chunks, out = generate(runner, f"{parser}s", [*_tokens(text), "<|end|>"], stream=True)
    # streamed, as vLLM's stream it: reasoning pieces, which the result holds too (the
    # blocks one after the other, as its reasoning parser reads them)
    assert (out["reasoning_content"], out["content"]) == ("Let me think.Still.", "Done.")
    for key in ("reasoning_content", "content"):
        assert "".join(c[key] for c in chunks) == out[key]
    assert [json.loads(c["function"]["arguments"]) for c in out["tool_calls"]] == [{"n": 1}]
    # whole, as vLLM's read it: no reasoning, the same content and calls
    _, whole = generate(runner, f"{parser}w", [*_tokens(text), "<|end|>"])
    assert "reasoning_content" not in whole and whole["content"] == "Done."
    assert _args(whole["tool_calls"]) == _args(out["tool_calls"])
    # with its reasoning parser too, a whole result holds the reasoning
    both = _split(parser, {}, reasoning=True).result(text)
    assert both["reasoning_content"] == out["reasoning_content"]
    assert (both["content"], _args(both["tool_calls"])) == ("Done.", _args(out["tool_calls"]))
