"""Pythonic tool calls (``[f(a=1), g(b="x")]``) streamed as written: each keyword argument
once a comma or the call's ``)`` ends it, each call whole at its ``)``, before the list
closes; the pieces add up to the calls the whole list reads."""

from __future__ import annotations

import ast
import itertools
import json
import random
from typing import Any

from batchfleet.schemas.tools import ToolUse
from batchfleet.worker.generation.json_compact import compact
from batchfleet.worker.generation.python_calls import ArgsScanner, call_of, opening
from test_generation_tool_chunks import _replay, _stream


def _scan(text: str, at: int) -> tuple[ArgsScanner, list[list[tuple[str, Any]]]]:
    """``text`` fed to a scanner from ``at`` a character at a time: it, and its pairs
    after each."""
    s = ArgsScanner(at)
    seen = [list(s.feed(text[:end]).pairs) for end in range(at, len(text) + 1)]
    return s, seen


TEXTS = [
    "f(city=\"Paris, France\", note='it\\'s (odd) [x]', days=3)",
    'f(a="""tri"ple "" quo,tes""", b=\'\'\'x\'\'\', c="")',
    'f(opts={"a": [1, (2, 3)], "b": {"c": None}}, flag=True, neg=-2.5, n=null)',
    "f(path='C:\\\\dir\\\\', empty=[], t=(1,),)",  # a trailing comma
    "f()",
    'f(s="x\\\\", e="\\"q\\"")',
]


def test_the_scanner_reads_each_argument_as_the_whole_call_does() -> None:
    for text in TEXTS:
        s, seen = _scan(text, 2)
        _, whole = call_of(ast.parse(text, mode="eval").body)
        assert s.end == len(text) and not s.failed, text
        assert dict(seen[-1]) == whole and len(seen[-1]) == len(whole), text
        # pairs only ever added, each once its comma or ")" is written
        for before, after in itertools.pairwise(seen):
            assert after[: len(before)] == before, text


def test_an_argument_comes_once_ended_not_before() -> None:
    _s, seen = _scan('f(city="a, b", days=12)', 2)
    grew = [k for k in range(1, len(seen)) if len(seen[k]) > len(seen[k - 1])]
    text = 'f(city="a, b", days=12)'
    assert [text[2 + k - 1] for k in grew] == [",", ")"]  # the comma after "a, b"'s end
    assert seen[-1] == [("city", "a, b"), ("days", 12)]


def test_what_is_not_a_keyword_literal_stops_the_arguments() -> None:
    for text, kept in [("f(a=1, 2, b=3)", [("a", 1)]), ("f(a=1, b=x.y)", [("a", 1)]),
                       ("f(**k)", []), ("f(a=1]", [])]:  # fmt: skip
        s, seen = _scan(text, 2)
        assert s.failed and seen[-1] == kept and s.end is not None, text
    s, _ = _scan('f(a="open', 2)
    assert s.end is None and not s.failed  # still being written


def test_a_call_begins_at_its_name_and_parenthesis() -> None:
    assert opening("<|python_start|> [get.time(", 0) == (18, "get.time", 27)
    assert opening("[get_time", 0) is None and opening("get_time(", 0) is None
    assert opening("[a(x=1), b(", 7) == (9, "b", 11)
    assert opening("[a(x=1)]", 7) is None


def test_pythonic_calls_stream_argument_by_argument_before_the_list_closes() -> None:
    text = ('[get_weather(city="Paris, France", days=3, opts={"unit": "c"}), '
            "get_time(zone='utc')]")  # fmt: skip
    reader, steps = _stream(ToolUse("auto"), "pythonic", text)
    first, second = reader.calls
    assert _replay([c for s in steps for c in s]) == {0: first, 1: second}
    assert json.loads(first["function"]["arguments"]) == {
        "city": "Paris, France", "days": 3, "opts": {"unit": "c"}}  # fmt: skip
    pieces = [(k, c["function"]["arguments"]) for k, s in enumerate(steps) for c in s]
    assert [p for _, p in pieces if p] == ['{', '"city":"Paris, France"', ',"days":3',
                                          ',"opts":{"unit":"c"}', "{", '"zone":"utc"',
                                          "}", "}"]  # fmt: skip
    # the second call begins (index 1) before the list closes and the reader reads both
    read = next(k for k, s in enumerate(steps) if any(c["function"]["arguments"] == "}"
                                                        for c in s))  # fmt: skip
    begun = next(k for k, s in enumerate(steps) for c in s if c["index"] == 1)
    assert begun < read


def test_a_list_that_turns_out_no_list_of_calls_leaves_its_calls_out() -> None:
    # streamed, then not made: the result has none; each kept its index
    text = "[a(q=1), b(2)]"
    reader, steps = _stream(ToolUse("auto"), "pythonic", text)
    assert reader.calls == []
    streamed = _replay([c for s in steps for c in s])
    assert [c["function"] for c in streamed.values()] == [
        {"name": "a", "arguments": '{"q":1'}, {"name": "b", "arguments": "{"}]  # fmt: skip
    # parallel calls off: the first only
    reader, steps = _stream(ToolUse("auto", parallel=False), "pythonic", "[a(q=1), b(r=2)]")
    assert [c["function"]["name"] for c in reader.calls] == ["a"]
    assert list(_replay([c for s in steps for c in s])) == [0]


def _value(rnd: random.Random, depth: int = 0) -> Any:
    kind = rnd.randrange(7 if depth < 2 else 4)
    if kind == 0:
        return "".join(rnd.choice("ab ,()[]{}'\"\\\n#=é") for _ in range(rnd.randrange(6)))
    if kind == 1:
        return rnd.randint(-1000, 1000)
    if kind == 2:
        return rnd.choice([None, True, False, 2.5, -0.125])
    if kind == 3:
        return ""
    if kind == 4:
        return [_value(rnd, depth + 1) for _ in range(rnd.randrange(3))]
    if kind == 5:
        return {f"k{i}": _value(rnd, depth + 1) for i in range(rnd.randrange(3))}
    return tuple(_value(rnd, depth + 1) for _ in range(rnd.randrange(1, 3)))


def test_random_arguments_stream_to_the_calls_the_list_reads() -> None:
    rnd = random.Random(13)
    for _ in range(150):
        args = {f"p{i}": _value(rnd) for i in range(rnd.randrange(4))}
        body = ", ".join(f"{k}={v!r}" for k, v in args.items())
        text = f"[tool({body}), other()]"
        reader, steps = _stream(ToolUse("auto"), "pythonic", text, step=rnd.randint(1, 5))
        first, _ = reader.calls
        assert json.loads(first["function"]["arguments"]) == json.loads(
            json.dumps(args))  # tuples read as lists  # fmt: skip
        assert first["function"]["arguments"] == compact(json.loads(json.dumps(args)))
        assert _replay([c for s in steps for c in s]) == dict(enumerate(reader.calls))
