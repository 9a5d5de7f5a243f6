"""Tool calls streamed as they are written (OpenAI's ``delta.tool_calls``): the compact JSON
rewriter, each parser's open call, and chunks that add up to the result's calls."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from batchfleet.schemas.tools import ToolUse
from batchfleet.worker.generation import tool_formats, tools
from batchfleet.worker.generation.json_compact import DECODER, Compactor, compact
from batchfleet.worker.generation.tool_chunks import CallChunks
from batchfleet.worker.generation.tools import PARSERS, CallReader
from test_generation_tools import FORMATS, V32, parser_of


def _feed(raw: str) -> tuple[Compactor, list[str]]:
    """``raw`` fed a character at a time: the compactor, and its text after each."""
    c = Compactor()
    seen = []
    for end in range(len(raw) + 1):
        c.feed(raw[:end])
        seen.append(c.text)
    return c, seen


TRICKY = [
    '{"a": 1, "b": [1, 2.50, {"c": null}], "d": "x\\u00e9\\n\\ud83d\\ude00 \\"q\\" é"}',
    '{"e": true, "f": -1e2, "g": 1E400, "h": -0, "i": 12345678901234567890}',
    "{ }",
    '{"x": [ ], "y": {}, "z": [[], [{}]]}',
    '{"lone": "\\ud800x", "low": "\\udc00", "end": "\\ud83d"}',
    '{"n": NaN, "m": -Infinity, "s": "b\\/c\\b\\f\\r\\t\\u0001"}',
    '{"a": 1, "b": 2, "a": 3}',  # a key written twice: kept twice, the last counts
]


@pytest.mark.parametrize("raw", TRICKY)
def test_the_compactor_writes_compacts_text_as_the_raw_text_comes(raw: str) -> None:
    c, seen = _feed(raw)
    whole = compact(DECODER.decode(raw))
    assert c.end == len(raw) and not c.failed and c.text == whole
    # each text so far is a start of the whole one: pieces only ever added
    assert all(whole.startswith(s) for s in seen)
    assert json.loads(whole) == json.loads(raw) or "NaN" in raw
    whole.encode()  # valid UTF-8: a lone surrogate is written escaped
    if raw.startswith('{"a": 1, "b": 2'):
        assert whole == '{"a":1,"b":2,"a":3}' and json.loads(whole) == {"a": 3, "b": 2}


def test_a_number_or_an_escape_is_held_until_it_ends() -> None:
    _, seen = _feed('{"n": 1.25, "s": "\\u00e9"}')
    assert not any(s.startswith('{"n":1') and not s.startswith('{"n":1.25,') for s in seen)
    assert '{"n":1.25,' in seen  # 1 may become 1.25: the number comes once it ends
    assert '{"n":1.25,"s":"' in seen and '{"n":1.25,"s":"é' in seen
    assert not any(s.endswith("\\") for s in seen)


@pytest.mark.parametrize(
    "bad",
    ['{"a": 1,}', "[1]", '"x"', '{"a" 1}', '{"a": 01}', '{"a": tru}', '{"a": "x\ny"}',
     '{"a": [1,]}', '{"a": "\\x"}', '{"a": "\\u12g4"}', "{" * 300],
)  # fmt: skip
def test_the_compactor_stops_at_what_is_not_json(bad: str) -> None:
    c, seen = _feed(bad)
    assert c.failed and c.end is None
    assert all(seen[-1].startswith(s) for s in seen)  # nothing taken back
    if bad[0] == "{":  # the others are JSON, but not an object of arguments
        with pytest.raises(ValueError):
            DECODER.decode(bad)


def test_the_compactor_ends_at_the_objects_end() -> None:
    c = Compactor()
    c.feed('{"a": [1, "]}"]} and then </tool_call>')
    assert c.end == len('{"a": [1, "]}"]}') and c.text == '{"a":[1,"]}"]}'


def test_the_compactor_agrees_with_json_on_random_values() -> None:
    rnd = random.Random(7)

    def value(depth: int = 0) -> Any:
        r = rnd.random()
        if depth > 3 or r < 0.35:
            return rnd.choice([0, 1, -2.5, 1e20, 3.0, "", 's\u00e9"\\\n\t/', True, False, None])
        if r < 0.65:
            return [value(depth + 1) for _ in range(rnd.randint(0, 3))]
        return {rnd.choice("abcdé"): value(depth + 1) for _ in range(rnd.randint(0, 3))}

    for _ in range(300):
        v = {"k": value()}
        raw = json.dumps(v, indent=rnd.choice([None, 2]), ensure_ascii=rnd.random() < 0.5)
        c, seen = _feed(raw)
        whole = json.dumps(v, ensure_ascii=False, separators=(",", ":"))
        assert c.text == whole and c.end == len(raw)
        assert all(whole.startswith(s) for s in seen)


def _replay(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Chunks added up by index, as an OpenAI client does."""
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        if c["index"] not in calls:
            assert set(c) == {"index", "id", "type", "function"} and c["type"] == "function"
            assert set(c["function"]) == {"name", "arguments"}
            calls[c["index"]] = {"id": c["id"], "type": "function",
                                 "function": {"name": c["function"]["name"], "arguments": ""}}  # fmt: skip
        else:
            assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
            assert c["function"]["arguments"]  # no empty pieces after the first
        calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    return calls


def _stream(use: ToolUse, parser: str | None, text: str, types: Any = None,
            step: int = 1) -> tuple[CallReader, list[list[dict[str, Any]]]]:  # fmt: skip
    """``text`` read ``step`` characters at a time, as a streaming runner does: the
    reader, and the chunks after each read (the last: the final read's)."""
    reader, out, _ = _streamed(use, parser, text, types, step)
    return reader, out


def _streamed(use: ToolUse, parser: str | None, text: str, types: Any = None,
              step: int = 1) -> tuple[CallReader, list[list[dict[str, Any]]], list[int]]:  # fmt: skip
    """:func:`_stream`'s, and how many calls were read whole after each read."""
    reader = CallReader(use, parser, types)
    chunks = CallChunks(reader, use, parser, types or {})
    out, whole = [], []
    for end in [*range(0, len(text), step), len(text)]:
        if CallReader.may_complete(text[max(0, end - step) : end]):
            reader.read(text[:end])
        out.append(chunks.chunks(text[:end]))
        whole.append(len(reader.calls))
    reader.read(text, final=True)
    out.append(chunks.chunks(text, final=True))
    whole.append(len(reader.calls))
    return reader, out, whole


STREAMED = {"hermes", "llama3_json", "mistral", "mistral_v11", "required", "qwen3_coder",
            "glm45", "deepseek_v3", "deepseek_v31", "kimi_k2", "openai", "seed_oss",
            "minimax_m2", "internlm", "granite", "hunyuan_a13b", "minimax", "jamba",
            "phi4_mini_json", "xlam", "xlam_fenced", "xlam_marked", "xlam_tagged", "llama4_json",
            "longcat", "ernie45", "step3", "pythonic", "llama4_pythonic", "olmo3", "gigachat3",
            "gigachat3_v31", "deepseek_v32", "granite4", "step3p5", "ling3", "poolside_v1",
            "hy_v3", "solar_open2", "lfm2", "apertus", "dots", "deepseek_v4", "granite-20b-fc",
            "functiongemma", "gemma4", "minicpm5", "kimi_k3", "minimax_m3"}  # fmt: skip
"""The formats whose calls stream before they are complete (all here)."""


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_formats_chunks_add_up_to_the_results_calls(fmt: str, step: int) -> None:
    text, _ = FORMATS[fmt]
    parser = parser_of(fmt)
    use = ToolUse("required") if fmt == "required" else ToolUse("auto")
    types = {"a": {"q": "integer"}, "b": {}}
    reader, steps, whole = _streamed(use, parser, text, types, step)
    calls = _replay([c for s in steps for c in s])
    assert list(calls) == [0, 1]
    assert [calls[k] for k in calls] == reader.calls  # same ids, names, arguments
    first = next(i for i, s in enumerate(steps) if s)
    complete = next(i for i, n in enumerate(whole) if n)  # the first call read whole
    if fmt in STREAMED:
        # its name and a start of its arguments come before its text is complete
        assert first < complete
        assert steps[first][0]["function"] == {"name": "a", "arguments": ""}
        head = "".join(c["function"]["arguments"] for s in steps[:complete] for c in s
                       if c["index"] == 0)  # fmt: skip
        assert head and '{"q":1}'.startswith(head)
    else:  # whole, once complete
        assert first == complete
        assert steps[first][0]["function"] == {"name": "a", "arguments": '{"q":1}'}


def test_arguments_stream_piece_by_piece_and_the_id_stays() -> None:
    args = {"path": "src/app.py", "code": 'print("héllo")\n' * 3, "lines": [1, 2.5]}
    text = ('I will write it.<tool_call>\n{"name": "write", "arguments": '
            + json.dumps(args, indent=1) + "}\n</tool_call>")  # fmt: skip
    reader, steps = _stream(ToolUse("auto"), "hermes", text)
    pieces = [c for s in steps for c in s]
    (call,) = reader.calls
    assert _replay(pieces) == {0: call}
    assert call["function"]["arguments"] == json.dumps(args, ensure_ascii=False,
                                                       separators=(",", ":"))  # fmt: skip
    assert len(pieces) > 40  # the code came a few characters at a time
    assert pieces[0]["id"] == call["id"] and call["id"].startswith("call_")


ST, V, SO = tool_formats.STEP, V32, tool_formats.SOLAR
TAGGED = {
    "qwen3_coder": ("<tool_call>\n<function=f>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "Paris"),
    "step3": (f'{ST[0]}{ST[2]}function{ST[4]}<steptml:invoke name="f"><steptml:parameter '
              'name="city"> Paris </steptml:parameter><steptml:parameter name="days">3'
              f"</steptml:parameter></steptml:invoke>{ST[3]}{ST[1]}", "Paris"),
    "deepseek_v32": (f'Sure.{V[0]}\n{V[2]} name="f">\n{V[4]} name="city" string="true"> Paris '
                     f'{V[5]}\n{V[4]} name="days" string="false">3{V[5]}\n{V[3]}\n{V[1]}',
                     " Paris "),  # a string="true" value as written
    "hy_v3": ("<tool_calls><tool_call>f<tool_sep><arg_key>city</arg_key><arg_value> Paris "
              "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call></tool_calls>",
              " Paris "),
    "solar_open2": (f"{SO[0]}f\n{SO[2]}city{SO[3]}Paris{SO[4]}\n{SO[2]}days{SO[3]}3{SO[4]}\n"
                    f"{SO[1]}", "Paris"),
    "minicpm5": ('<function name="f">\n<param name="city"> Paris </param>\n'
                 '<param name="days">3</param>\n</function>', "Paris"),
    "kimi_k3": ('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument '
                'key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument '
                'key="days" type="integer"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
                "<|close|>tools<|sep|>", "Paris"),
    "minimax_m3": ('Sure.]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="f">]<]minimax[>[<city>'
                   "Paris]<]minimax[>[</city>]<]minimax[>[<days>3]<]minimax[>[</days>]<]minimax[>["
                   "</invoke>\n]<]minimax[>[</tool_call>", "Paris"),
}  # fmt: skip
"""A call of ``f(city="Paris", days=3)`` in typed formats, and the city as read."""


@pytest.mark.parametrize("parser", TAGGED)
def test_typed_parameters_stream_each_once_written(parser: str) -> None:
    text, city = TAGGED[parser]
    reader, steps = _stream(ToolUse("auto"), parser, text, {"f": {"days": "integer"}})
    pieces = [c["function"]["arguments"] for s in steps for c in s]
    assert pieces == ["", "{", f'"city":"{city}"', ',"days":3', "}"]
    assert reader.calls[0]["function"]["arguments"] == f'{{"city":"{city}","days":3}}'


def test_olmo3_calls_stream_before_their_block_closes() -> None:
    text = "<function_calls>\nf(city='Paris', days=3)\ng(x=[1, 2])\n</function_calls>"
    reader, steps = _stream(ToolUse("auto"), "olmo3", text)
    assert _replay([c for s in steps for c in s]) == dict(enumerate(reader.calls))
    firsts = [k for k, s in enumerate(steps) for c in s if "id" in c]
    closed = len(text) - len("</function_calls>")
    assert len(firsts) == 2 and firsts[1] < closed  # g's name before the block closes
    f = [c["function"]["arguments"] for s in steps for c in s if c["index"] == 0]
    assert f == ["", "{", '"city":"Paris"', ',"days":3', "}"]
    # a call on the same line as another is not followed (it comes whole, once read), nor
    # a call after the block
    text = "<function_calls>f(), g()</function_calls>\nh(x=1)"
    _, steps = _stream(ToolUse("auto"), "olmo3", text)
    assert [c["function"] for s in steps for c in s if "id" in c] == [
        {"name": "f", "arguments": ""}, {"name": "g", "arguments": "{}"}]  # fmt: skip


@pytest.mark.parametrize("fmt", ["xlam", "xlam_fenced", "xlam_marked", "xlam_tagged",
                                 "phi4_mini_json", "jamba", "apertus"])  # fmt: skip
def test_arrays_of_calls_stream_each_call_as_written(fmt: str) -> None:
    # a next call in the array, or in a next wrapper, streams as the first did
    text, _ = FORMATS[fmt]
    text = text.replace('"b", "arguments": {}', '"b", "arguments": {"r": "x"}')
    text = text.replace('"b", "arguments": "{}"', '"b", "arguments": {"r": "x"}')
    text = text.replace('"b", "parameters": {}', '"b", "parameters": {"r": "x"}')
    text = text.replace('{"b": {}}', '{"b": {"r": "x"}}')
    reader, steps = _stream(ToolUse("auto"), parser_of(fmt), text)
    assert _replay([c for s in steps for c in s]) == dict(enumerate(reader.calls))
    b = [c for s in steps for c in s if c["index"] == 1]
    assert b[0]["function"] == {"name": "b", "arguments": ""} and len(b) > 3, b


def test_a_wrapped_xlam_array_after_another_streams_too() -> None:
    text = ('Sure.\n```json\n[{"name": "a", "arguments": {"q": 1}}]\n```\nAnd:\n<tool_call>'
            '[{"name": "b", "arguments": {"r": 2}}]</tool_call>')  # fmt: skip
    reader, steps = _stream(ToolUse("auto"), "xlam", text)
    calls = _replay([c for s in steps for c in s])
    assert list(calls.values()) == reader.calls and len(reader.calls) == 2
    assert len([c for s in steps for c in s if c["index"] == 1]) > 3
    assert reader.content == "Sure."  # the text between calls is not content (as hermes's)


@pytest.mark.parametrize(("alias", "parser"), list(tools.ALIASES.items()))
def test_vllms_other_names_stream_as_their_formats(alias: str, parser: str) -> None:
    text, _ = FORMATS[parser]
    _, alias_steps = _stream(ToolUse("auto"), alias, text)
    _, steps = _stream(ToolUse("auto"), parser, text)

    def shape(steps: list[list[dict[str, Any]]]) -> list[list[Any]]:
        return [[(c["index"], c["function"]) for c in s] for s in steps]

    assert shape(alias_steps) == shape(steps)


def test_a_call_written_badly_keeps_its_index_and_the_next_takes_the_next() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {"q": 1</tool_call>'
            '<tool_call>{"name": "b", "arguments": {"r": 2}}</tool_call>')  # fmt: skip
    reader, steps = _stream(ToolUse("auto"), "hermes", text)
    calls = _replay([c for s in steps for c in s])
    assert [c["function"]["name"] for c in reader.calls] == ["b"]
    assert list(calls) == [0, 1] and calls[1] == reader.calls[0]
    assert calls[0]["function"]["name"] == "a" and calls[0]["id"] != calls[1]["id"]


def test_a_call_that_turns_out_another_is_streamed_whole_under_a_new_index() -> None:
    # the object names its arguments twice: its chunks followed the first, the call the last
    text = '<tool_call>{"name": "a", "arguments": {"q": 1}, "arguments": {"q": 2}}</tool_call>'
    reader, steps = _stream(ToolUse("auto"), "hermes", text)
    calls = _replay([c for s in steps for c in s])
    (call,) = reader.calls
    assert call["function"]["arguments"] == '{"q":2}'
    assert list(calls) == [0, 1] and calls[1] == call and calls[0]["id"] != call["id"]


def test_one_call_only_without_parallel_calls() -> None:
    text, _ = FORMATS["hermes"]
    reader, steps = _stream(ToolUse("auto", parallel=False), "hermes", text)
    calls = _replay([c for s in steps for c in s])
    assert list(calls) == [0] and calls[0] == reader.calls[0]


def test_a_named_functions_arguments_stream_from_the_first_brace() -> None:
    text = '{"city": "Paris", "days": 3}'
    reader, steps = _stream(ToolUse("named", "f", False), None, text)
    assert steps[0] == []  # nothing yet
    assert steps[1] == [{"index": 0, "id": reader.calls[0]["id"], "type": "function",
                         "function": {"name": "f", "arguments": ""}},
                        {"index": 0, "function": {"arguments": "{"}}]  # fmt: skip
    assert _replay([c for s in steps for c in s]) == {0: reader.calls[0]}


def test_kimi_keeps_the_models_id_from_the_first_chunk() -> None:
    text, _ = FORMATS["kimi_k2"]
    reader, steps = _stream(ToolUse("auto"), "kimi_k2", text)
    first = [c for s in steps for c in s if "id" in c]
    assert [c["id"] for c in first] == ["functions.a:0", "functions.b:1"]
    assert [c["id"] for c in reader.calls] == ["functions.a:0", "functions.b:1"]


@pytest.mark.parametrize("parser", PARSERS)
def test_text_without_calls_streams_no_chunks(parser: str) -> None:
    for text in ["I cannot <b>call</b> that.", "Plain, then <tool_call> cut", "{not a call}"]:
        reader, steps = _stream(ToolUse("auto"), parser, text)
        # (glm45's format reads a block cut by the end as a call: "cut", no arguments)
        assert _replay([c for s in steps for c in s]) == dict(enumerate(reader.calls))
        glm = tools.ALIASES.get(parser, parser) == "glm45"
        assert bool(reader.calls) == (glm and "cut" in text)


@pytest.mark.parametrize("fmt", FORMATS)
def test_any_cut_and_any_pace_keeps_the_chunks_consistent(fmt: str) -> None:
    # a text cut anywhere (length, a deadline) and streamed at random paces: every call the
    # result holds is streamed whole under one index, with its id; every other index is a
    # call begun but not made (the result leaves it out)
    text, _ = FORMATS[fmt]
    parser = parser_of(fmt)
    use = ToolUse("required") if fmt == "required" else ToolUse("auto")
    types = {"a": {"q": "integer"}, "b": {}}
    rnd = random.Random(fmt)
    for _ in range(40):
        cut = text[: rnd.randint(0, len(text))]
        reader, steps = _stream(use, parser, cut, types, rnd.randint(1, 7))
        calls = _replay([c for s in steps for c in s])
        by_id = {c["id"]: c for c in calls.values()}
        assert len(by_id) == len(calls)  # ids unique across indices
        for made in reader.calls:
            assert by_id[made["id"]] == made
        made = [calls[k] for k in sorted(calls) if calls[k] in reader.calls]
        assert made == reader.calls  # in the result's order
        orphans = [c for c in calls.values() if c not in reader.calls]
        # (a list's calls are read once it closes)
        if parser in ("pythonic", "llama4_pythonic", "olmo3", "lfm2") and not reader.calls:
            assert len(orphans) <= 2 and all(o["function"]["name"] in "ab" for o in orphans)
        else:
            assert len(orphans) <= 1  # at most the one being written at the cut
