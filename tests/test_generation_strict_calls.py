"""``tool_choice`` ``auto`` with ``strict`` functions: the text stays free, and a call,
once its marker is written, follows the model's format and the function's schema
(``worker/generation/strict_calls.py``), whether the marker is a special token or text."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.tools import Tool, ToolUse  # noqa: E402
from batchfleet.worker.generation import strict_calls, tool_formats, tools  # noqa: E402
from batchfleet.worker.generation.tagged_args import param_types  # noqa: E402
from batchfleet.worker.generation.tool_formats import STEP as ST  # noqa: E402
from batchfleet.worker.generation.tools import read_calls  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_reasoning import compiled  # noqa: E402
from test_generation_runner import run  # noqa: E402
from test_generation_tools import TOOLS, WEATHER, chat  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402


def _strict(*names: str) -> list[dict[str, Any]]:
    tools = copy.deepcopy(TOOLS)
    for t in tools:
        if t["function"]["name"] in names:
            t["function"]["strict"] = True
    return tools


@pytest.fixture(scope="module", params=["special", "text"])
def hermes(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> TextGenerationRunner:  # fmt: skip
    """A tiny hermes model whose tokenizer makes the markers special tokens, or not."""
    specials = ("<tool_call>", "</tool_call>") if request.param == "special" else ()
    path = make_causal_lm(tmp_path_factory.mktemp(f"tiny-hermes-{request.param}"),
                          specials=specials)  # fmt: skip
    return TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, "tool_call_parser": "hermes"})  # fmt: skip


def _accepts(runner: TextGenerationRunner, sampling: Any, text: str) -> bool:
    m = sampling.constraint.matcher()
    ids = runner.tokenizer.encode(text, add_special_tokens=False)
    return bool(m.consume_tokens(ids) and m.is_accepting())


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 3}}\n</tool_call>'


def test_strict_functions_hold_the_calls_and_free_the_text(hermes: TextGenerationRunner) -> None:
    (prep,) = hermes.prepare_many([chat("s", tools=_strict("get_weather"))])
    strict = compiled(prep)
    assert _accepts(hermes, strict, "No call needed: it is sunny.")
    assert _accepts(hermes, strict, f"Let me check. {CALL} Done.")
    assert _accepts(hermes, strict, CALL + CALL)  # parallel calls
    bad_days = CALL.replace('"days": 3', '"days": 9')  # maximum 7
    assert not _accepts(hermes, strict, bad_days)
    assert not _accepts(hermes, strict, "x <tool_call> not json")
    assert not _accepts(hermes, strict, CALL.replace("get_weather", "get_moon"))
    # a function that is not strict: its arguments any object, its name still one of them
    other = '<tool_call>{"name": "get_time", "arguments": {"zone": "mars", "x": 1}}</tool_call>'
    assert _accepts(hermes, strict, other)
    # one call at most without parallel calls
    (prep,) = hermes.prepare_many([chat("p", tools=_strict("get_weather"),
                                        parallel_tool_calls=False)])  # fmt: skip
    assert not _accepts(hermes, compiled(prep), CALL + CALL)
    # no strict function, or another tool choice: as before
    (prep,) = hermes.prepare_many([chat("f")])
    assert prep.payload.sampling.constraint is None and prep.payload.compiling is None  # type: ignore[union-attr]


def test_a_strict_call_the_model_makes_follows_its_schema(tmp_path: Path) -> None:
    # pushed to open a call (the marker, a special token), the random model writes the
    # rest as the grammar holds it; one call (parallel off), then free text to the length
    path = make_causal_lm(tmp_path / "m", specials=("<tool_call>", "</tool_call>"))
    hermes = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": "hermes"})  # fmt: skip
    bias = {str(hermes.tokenizer.convert_tokens_to_ids("<tool_call>")): 100.0}
    req = chat("g", tools=_strict("get_weather", "get_time"), logit_bias=bias,
               parallel_tool_calls=False, max_new_tokens=120)  # fmt: skip
    (out,) = run(hermes, req)["g"]
    assert "tool_calls" in out, out
    (call,) = out["tool_calls"]
    fn = call["function"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
    assert out["text"].startswith("<tool_call>"), out["text"]


def test_every_format_holds_strict_calls(tiny_lm: Path) -> None:
    # (gpt-oss's: harmony.auto_grammar; Cohere Command's: cohere.auto_grammar)
    held = set(tools.PARSERS) - {"openai", "cohere_command3", "cohere_command4"}
    for parser in held - strict_calls.UNHELD:
        name = tools.ALIASES.get(parser, parser)
        assert strict_calls.grammar(name, [("f", WEATHER, True)], True, lambda m: None), parser
    for parser in strict_calls.UNHELD:  # (not enforced: see UNHELD)
        assert strict_calls.grammar(parser, [("f", WEATHER, True)], True, lambda m: None) is None
    # mistral's [TOOL_CALLS] where it is no token of its own (this tokenizer): text
    mistral = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                   options={**TINY_LM_OPTIONS, "tool_call_parser": "mistral"})  # fmt: skip
    (prep,) = mistral.prepare_many([chat("m", tools=_strict("get_weather"))])
    held = compiled(prep)
    assert _accepts(mistral, held, f"Sure.[TOOL_CALLS]{ARRAY}")
    assert not _accepts(mistral, held, f"Sure.[TOOL_CALLS]{ARRAY.replace('1}', '8}')}")
    # an alias reads as its parser: ernie45 is hermes's format
    ernie = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                 options={**TINY_LM_OPTIONS, "tool_call_parser": "ernie45"})  # fmt: skip
    (prep,) = ernie.prepare_many([chat("e", tools=_strict("get_weather"))])
    assert _accepts(ernie, compiled(prep), f"ok {CALL}")
    # and qwen3_xml is qwen3_coder's: its parameters held by their schemas
    xml = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                               options={**TINY_LM_OPTIONS, "tool_call_parser": "qwen3_xml"})  # fmt: skip
    (prep,) = xml.prepare_many([chat("x", tools=_strict("get_weather"))])
    call = _typed_call("qwen3_coder", "get_weather", {"unit": "c", "days": "3"})
    assert _accepts(xml, compiled(prep), f"ok <tool_call>\n{call}\n</tool_call>")
    bad = _typed_call("qwen3_coder", "get_weather", {"unit": "c", "days": "9"})
    assert not _accepts(xml, compiled(prep), f"ok <tool_call>\n{bad}\n</tool_call>")


ARRAY = '[{"name": "get_weather", "arguments": {"unit": "f", "days": 1}}]'


@pytest.mark.parametrize(("parser", "opening", "closing", "special"), [
    ("granite", "<|tool_call|>", "", True),
    ("hunyuan_a13b", "<tool_calls>", "</tool_calls>", False),
    ("jamba", "<tool_calls>", "</tool_calls>", True),  # hunyuan_a13b's format
    ("minimax", "<tool_calls>", "</tool_calls>", False),  # objects, not an array
    ("phi4_mini_json", "functools", "", False),  # its "functools[" opens the calls
    ("apertus", "<|tools_prefix|>", "<|tools_suffix|>", True),  # {NAME: ARGUMENTS} objects
])  # fmt: skip
def test_arrays_after_a_marker_are_held_too(
    parser: str, opening: str, closing: str, special: bool, tmp_path: Path
) -> None:
    specials = tuple(m for m in (opening, closing) if m) if special else ()
    path = make_causal_lm(tmp_path / parser, specials=specials)
    array, two = ARRAY, ARRAY[:-1] + ', {"name": "get_time", "arguments": {"zone": "cet"}}]'
    if parser == "minimax":  # MiniMax-M1: one object a line
        array, two = array[1:-1], two[1:-1].replace("}, {", "}\n{")
    if parser == "apertus":
        array = '[{"get_weather": {"unit": "f", "days": 1}}]'
        two = array[:-1] + ', {"get_time": {"zone": "cet"}}]'
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": parser})  # fmt: skip
    (prep,) = runner.prepare_many([chat("a", tools=_strict("get_weather"))])
    strict = compiled(prep)
    assert _accepts(runner, strict, "Plain answer.")
    assert _accepts(runner, strict, f"Checking. {opening}{array}{closing} ok")
    assert _accepts(runner, strict, f"{opening}\n{two}{closing}")
    calls = read_calls(ToolUse("auto"), f"{opening}\n{two}{closing}", parser) or []
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]  # as read
    assert not _accepts(runner, strict, f"{opening}{array.replace('1}', '8}')}{closing}")
    assert not _accepts(runner, strict, f"{opening}{'' if parser == 'minimax' else '[]'}{closing}")
    assert not _accepts(
        runner, strict, f"{opening}{'{}' if parser == 'minimax' else '[{}]'}{closing}"
    )
    # prose that writes the marker stays free where the marker is text and opens an array
    prose = _accepts(runner, strict, f"{opening} not an array")
    assert prose == (parser == "phi4_mini_json")
    (prep,) = runner.prepare_many([chat("p", tools=_strict("get_weather"),
                                        parallel_tool_calls=False)])  # fmt: skip
    assert not _accepts(runner, compiled(prep), f"{opening}{two}{closing}")
    assert _accepts(runner, compiled(prep), f"{opening}{array}{closing}")


def _held(
    tmp_path: Path, parser: str, specials: tuple[str, ...]
) -> tuple[TextGenerationRunner, Any]:
    """A tiny ``parser`` model (``specials``: its special tokens) and the constraint of a
    request whose ``get_weather`` is strict."""
    path = make_causal_lm(tmp_path / parser, specials=specials)
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": parser})  # fmt: skip
    (prep,) = runner.prepare_many([chat(parser, tools=_strict("get_weather"))])
    return runner, compiled(prep)


@pytest.mark.parametrize("special", [True, False])
def test_xlam_calls_are_a_leading_array_or_follow_a_fence_or_marker(special: bool,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    tc, tag, end = "[TOOL_CALLS]", "<tool_call>", "</tool_call>"
    runner, strict = _held(tmp_path, "xlam", (tc, tag, end) if special else ())
    bad = ARRAY.replace("1}", "8}")
    two = ARRAY[:-1] + ', {"name": "get_time", "arguments": {"zone": "cet"}}]'
    good = ["Plain.", ARRAY, f" {two} ", f"Here:\n```json\n{two}\n```", f"Run ```{ARRAY}```",
            f"ok {tag}{ARRAY}{end}", f"{tc}{ARRAY}", f"So {tc} {two}", f"  {tc}{ARRAY}",
            f"  Well, {tc}{ARRAY}", f" {tag}{ARRAY}{end}",
            "Code: ```python\nx = [1]\n```"]  # fmt: skip
    for text in good:
        assert _accepts(runner, strict, text), text
        if "name" in text:  # calls, as the parser reads them
            assert read_calls(ToolUse("auto"), text, "xlam"), text
    for text in (bad, "[1, 2]", f"```json\n{bad}\n```", f"{tag}{bad}{end}", f"{tc}{bad}",
                 f"[not json {tag}{ARRAY}{end}", f"{tc} sunny", "```json\n[1]\n```"):  # fmt: skip
        assert not _accepts(runner, strict, text), text
    (prep,) = runner.prepare_many([chat("o", tools=_strict("get_weather"),
                                        parallel_tool_calls=False)])  # fmt: skip
    one = compiled(prep)
    assert _accepts(runner, one, f"ok {tag}{ARRAY}{end} done")
    for text in (two, f"```json\n{two}\n```", f"{tag}{ARRAY}{end} and {tc}{ARRAY}"):
        assert not _accepts(runner, one, text), text


@pytest.mark.parametrize("special", [True, False])
def test_internlm_calls_are_held_after_its_two_markers(special: bool, tmp_path: Path) -> None:
    start, plugin, end = "<|action_start|>", "<|plugin|>", "<|action_end|>"
    runner, strict = _held(tmp_path, "internlm", (start, plugin, end) if special else ())
    call = '{"name": "get_weather", "parameters": {"unit": "c", "days": 2}}'
    for text in ("Plain.", f"Let me check.{start}{plugin}\n{call}{end} done"):
        assert _accepts(runner, strict, text), text
    assert read_calls(ToolUse("auto"), f"{start}{plugin}{call}{end}", "internlm")
    for bad in (call.replace('"c"', '"k"'), call.replace("parameters", "arguments"), "{}"):
        assert not _accepts(runner, strict, f"{start}{plugin}{bad}{end}"), bad


@pytest.mark.parametrize("special", [True, False])
def test_llama3_json_calls_are_the_whole_text_or_none(special: bool, tmp_path: Path) -> None:
    tag = "<|python_tag|>"
    path = make_causal_lm(tmp_path / "llama", specials=(tag,) if special else ())
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": "llama3_json"})  # fmt: skip
    (prep,) = runner.prepare_many([chat("l", tools=_strict("get_weather"))])
    strict = compiled(prep)
    call = '{"name": "get_weather", "parameters": {"unit": "c", "days": 2}}'
    time = '{"name": "get_time", "parameters": {"zone": "x"}}'  # not strict: any object
    for text in ("It is sunny.", "", call, f"{tag}{call}", f"  {call}; {time}"):
        assert _accepts(runner, strict, text), text
        if text.lstrip().startswith(("{", tag)):  # calls, as the parser reads them
            assert read_calls(ToolUse("auto"), text, "llama3_json")
    for text in ('{"name": "get_weather", "parameters": {"unit": "k", "days": 2}}',
                 '{"weather": 1}', f"{tag}sunny", f"{call} and more"):  # fmt: skip
        assert not _accepts(runner, strict, text), text
    (prep,) = runner.prepare_many([chat("o", tools=_strict("get_weather"),
                                        parallel_tool_calls=False)])  # fmt: skip
    assert not _accepts(runner, compiled(prep), f"{call}; {time}")


SEARCH = {"type": "function", "function": {"name": "web.search", "strict": True, "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 12},
                                     "exact": {"type": "boolean"}, "limit": {"type": "integer"}},
    "required": ["q"]}}}  # fmt: skip


@pytest.mark.parametrize(("parser", "special"), [("pythonic", True), ("pythonic", False),
                                                 ("llama4_pythonic", True)])  # fmt: skip
def test_pythonic_calls_are_a_python_list_or_none(parser: str, special: bool,
                                                  tmp_path: Path) -> None:  # fmt: skip
    start, end = "<|python_start|>", "<|python_end|>"
    path = make_causal_lm(tmp_path / parser, specials=(start, end) if special else ())
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": parser})  # fmt: skip
    (prep,) = runner.prepare_many([chat("p", tools=[*_strict("get_weather"), SEARCH])])
    strict = compiled(prep)
    weather = 'get_weather(unit="c", days=3)'
    good = ["It is sunny.", "", f"[{weather}]", f"{start}[{weather}]{end}",
            f' [{weather}, get_time(zone="x", utc=True)]',  # get_time is not strict
            '[web.search(q="rain", exact=False, limit=5)]', '[web.search(q="rain",limit=2)]',
            '[web.search(q="rain")]']  # fmt: skip
    types = param_types([Tool.model_validate(t) for t in [*_strict("get_weather"), SEARCH]])
    for text in good:
        assert _accepts(runner, strict, text), text
        if "(" in text:  # calls, as the parser reads them
            assert read_calls(ToolUse("auto"), text, parser, types), text
    for text in ['[get_weather(unit="k", days=3)]', "[get_weather(days=3)]",  # bad, missing
                 '[get_weather(unit="c")]', '[web.search(exact=True, q="a")]',
                 '[get_weather(days=3, unit="c")]',  # not in the schema's order
                 '[get_weather(unit="c", unit="f", days=3)]', '[get_moon(phase="full")]',
                 '[web.search(q="a longer query than twelve")]', '[web.search(exact=True)]',
                 '[web.search(q="a", exact=1)]', f"[{weather}] and more",
                 f"[{weather},]", f"{start}sunny"]:  # fmt: skip
        assert not _accepts(runner, strict, text), text
    (prep,) = runner.prepare_many([chat("o", tools=_strict("get_weather"),
                                        parallel_tool_calls=False)])  # fmt: skip
    assert not _accepts(runner, compiled(prep), f' [{weather}, get_time(zone="x")]')
    # a function whose name is not a Python name cannot be called in this format
    assert (
        strict_calls.grammar("pythonic", [("get-x", WEATHER, True)], True, lambda m: None) is None
    )


@pytest.mark.parametrize("special", [True, False])
def test_olmo3_calls_are_a_python_call_a_line_in_one_block(special: bool, tmp_path: Path) -> None:
    start, end = "<function_calls>", "</function_calls>"
    runner, strict = _held(tmp_path, "olmo3", (start, end) if special else ())
    weather, time = 'get_weather(unit="c", days=3)', 'get_time(zone="x")'  # get_time: not strict
    for text in ("Plain.", f"Sure.\n{start}\n{weather}\n{time}\n{end}", f"{start}{weather}{end}"):
        assert _accepts(runner, strict, text), text
        if start in text:
            assert read_calls(ToolUse("auto"), text, "olmo3"), text
    for text in (f"{start}get_weather(days=3){end}", f"{start}[{weather}]{end}",
                 f"{start}{weather}, {time}{end}", f"{start}{weather}{end} {start}{time}{end}",
                 f"{start}sunny{end}"):  # fmt: skip
        assert not _accepts(runner, strict, text), text
    (prep,) = runner.prepare_many([chat("o", tools=_strict("get_weather"),
                                        parallel_tool_calls=False)])  # fmt: skip
    assert not _accepts(runner, compiled(prep), f"{start}{weather}\n{time}{end}")


@pytest.mark.parametrize("special", [True, False])
def test_lfm2_calls_are_a_python_list_in_one_block(special: bool, tmp_path: Path) -> None:
    start, end = "<|tool_call_start|>", "<|tool_call_end|>"
    runner, strict = _held(tmp_path, "lfm2", (start, end) if special else ())
    weather, time = 'get_weather(unit="c", days=3)', 'get_time(zone="x")'  # get_time: not strict
    for text in (
        "Plain.",
        f"Sure.{start}[{weather}, {time}]{end} Done.",
        f"{start}[{weather}]{end}",
    ):
        assert _accepts(runner, strict, text), text
        if start in text:
            assert read_calls(ToolUse("auto"), text, "lfm2"), text
    for text in (f"{start}[get_weather(days=3)]{end}", f"{start}{weather}{end}",
                 f"{start}[{weather}]{end} {start}[{time}]{end}", f"{start}sunny{end}"):  # fmt: skip
        assert not _accepts(runner, strict, text), text
    (prep,) = runner.prepare_many([chat("o", tools=_strict("get_weather"),
                                        parallel_tool_calls=False)])  # fmt: skip
    assert not _accepts(runner, compiled(prep), f"{start}[{weather}, {time}]{end}")


@pytest.mark.parametrize("special", [True, False])
def test_gigachat3_calls_follow_its_header(special: bool, tmp_path: Path) -> None:
    msg, sep = "<|message_sep|>", "<|role_sep|>"
    runner, strict = _held(tmp_path, "gigachat3", (msg, sep) if special else ())
    call = '{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}'
    for text in ("Plain.", "A function call is a call.", f"Sure.{msg}function call{sep}\n{call}",
                 f"function call{sep}{call}"):  # fmt: skip
        assert _accepts(runner, strict, text), text
        if sep in text:
            assert read_calls(ToolUse("auto"), text, "gigachat3"), text
    for bad in (call.replace('"c"', '"k"'), '{"name": "get_moon", "arguments": {}}', "sunny"):
        assert not _accepts(runner, strict, f"{msg}function call{sep}{bad}"), bad
    if special:  # the separator only after the header
        assert not _accepts(runner, strict, f"Sure.{sep}{call}")


def test_a_pythonic_call_the_model_makes_follows_its_schema(tmp_path: Path) -> None:
    start = "<|python_start|>"
    path = make_causal_lm(tmp_path / "m", specials=(start, "<|python_end|>"))
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": "pythonic"})  # fmt: skip
    bias = {str(runner.tokenizer.convert_tokens_to_ids(start)): 100.0}
    for seed in range(2):
        req = chat(f"p{seed}", tools=_strict("get_weather", "get_time"), logit_bias=bias,
                   max_new_tokens=160, temperature=1.0, seed=seed)  # fmt: skip
        (out,) = run(runner, req)[f"p{seed}"]
        assert out.get("tool_calls"), out
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in out["tool_calls"]:
            fn = call["function"]
            jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])


def _section_call(parser: str, name: str, args: str) -> str:
    ds, kimi = tool_formats.DS, tool_formats.KIMI
    if parser == "deepseek_v31":
        return f"{ds[2]}{name}{ds[4]}{args}{ds[3]}"
    if parser == "deepseek_v3":
        return f"{ds[2]}function{ds[4]}{name}\n```json\n{args}\n```{ds[3]}"
    return f"{kimi[2]}functions.{name}:0{kimi[4]}{args}{kimi[3]}"


def test_gigachat31_calls_are_held_after_its_token(tmp_path: Path) -> None:
    head = "<|function_call|>"
    path = make_causal_lm(tmp_path / "giga", specials=(head, "<|message_sep|>", "<|role_sep|>"))
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": "gigachat3"})  # fmt: skip
    (prep,) = runner.prepare_many([chat("g", tools=_strict("get_weather"))])
    strict = compiled(prep)
    call = '{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}'
    assert _accepts(runner, strict, "Plain answer.")
    assert _accepts(runner, strict, f"Checking.{head}{call}")
    calls = read_calls(ToolUse("auto"), f"Checking.{head}{call}", "gigachat3") or []
    assert [c["function"]["name"] for c in calls] == ["get_weather"]  # as read
    assert not _accepts(runner, strict, f"{head}{call.replace('2}', '0}')}")
    assert not _accepts(runner, strict, f"{head} sunny")
    assert not _accepts(runner, strict, f'{head}{{"name": "get_moon", "arguments": {{}}}}')


@pytest.mark.parametrize(("parser", "special"), [
    ("deepseek_v31", True), ("deepseek_v3", True), ("kimi_k2", True), ("deepseek_v31", False),
])  # fmt: skip
def test_sections_of_named_calls_are_held_too(parser: str, special: bool, tmp_path: Path) -> None:
    markers = tool_formats.KIMI if parser == "kimi_k2" else tool_formats.DS
    path = make_causal_lm(tmp_path / parser, specials=markers if special else ())
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": parser})  # fmt: skip
    (prep,) = runner.prepare_many([chat("d", tools=_strict("get_weather"))])
    strict = compiled(prep)
    weather = _section_call(parser, "get_weather", '{"unit": "c", "days": 5}')
    time = _section_call(parser, "get_time", '{"anything": [1]}')  # not strict
    section = f"{markers[0]}{weather}{time}{markers[1]}"
    assert _accepts(runner, strict, "Just text.")
    assert _accepts(runner, strict, f"Let me look. {section}")
    calls = read_calls(ToolUse("auto"), f"Let me look. {section}", parser) or []
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]  # as read
    bad = _section_call(parser, "get_weather", '{"unit": "c", "days": 0}')  # minimum 1
    assert not _accepts(runner, strict, f"{markers[0]}{bad}{markers[1]}")
    unknown = _section_call(parser, "get_moon", "{}")
    assert not _accepts(runner, strict, f"{markers[0]}{unknown}{markers[1]}")
    (prep,) = runner.prepare_many([chat("o", tools=_strict("get_weather"),
                                        parallel_tool_calls=False)])  # fmt: skip
    assert not _accepts(runner, compiled(prep), section)
    assert _accepts(runner, compiled(prep), f"{markers[0]}{weather}{markers[1]}")


def _typed_call(parser: str, name: str, params: dict[str, str] | list[tuple[str, str]]) -> str:
    items = list(params.items()) if isinstance(params, dict) else params
    if parser == "step3":
        body = "".join(f'<steptml:parameter name="{k}">{v}</steptml:parameter>' for k, v in items)
        return f'{ST[2]}function{ST[4]}<steptml:invoke name="{name}">{body}</steptml:invoke>{ST[3]}'
    if parser in ("deepseek_v32", "deepseek_v4"):  # a number's value JSON, another's text
        v = tool_formats.V32
        body = "".join(f'{v[4]} name="{k}" string="{str(not x.isdigit()).lower()}">{x}{v[5]}\n'
                       for k, x in items)  # fmt: skip
        return f'{v[2]} name="{name}">\n{body}{v[3]}\n'
    if parser in ("minimax_m2", "dots"):
        body = "".join(f'<parameter name="{k}">{v}</parameter>' for k, v in items)
        return f'<invoke name="{name}">{body}</invoke>'
    if parser == "glm45":
        body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                       for k, v in items)  # fmt: skip
        return f"{name}\n{body}"
    if parser == "hy_v3":
        body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in items)
        return f"<tool_call>{name}<tool_sep>{body}</tool_call>"
    if parser == "functiongemma":  # (a string's value too in <escape>: vLLM reads only those)
        return f"call:{name}{{" + ",".join(f"{k}:<escape>{v}<escape>" for k, v in items) + "}"
    if parser == "minicpm5":
        return f'name="{name}">' + "".join(f'<param name="{k}">{v}</param>' for k, v in items)
    if parser == "solar_open2":
        s = tool_formats.SOLAR
        return f"{name}\n" + "".join(f"{s[2]}{k}{s[3]}{v}{s[4]}\n" for k, v in items)
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in items)
    return f"<function={name}>\n{body}</function>"


@pytest.mark.parametrize("parser", ["qwen3_coder", "seed_oss", "minimax_m2", "glm45", "step3",
                                    "deepseek_v32", "hy_v3", "solar_open2", "dots",
                                    "deepseek_v4", "functiongemma", "minicpm5"])  # fmt: skip
def test_tagged_parameters_are_held_by_their_schemas(parser: str, tmp_path: Path) -> None:
    opening, closing = {"qwen3_coder": ("<tool_call>", "</tool_call>"),
                        "seed_oss": ("<seed:tool_call>", "</seed:tool_call>"),
                        "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
                        "glm45": ("<tool_call>", "</tool_call>"),
                        "step3": (ST[0], ST[1]),
                        "deepseek_v32": tool_formats.V32[:2],
                        "hy_v3": ("<tool_calls>", "</tool_calls>"),
                        "solar_open2": tool_formats.SOLAR[:2],
                        "dots": ("<dots_function_call>", "</dots_function_call>"),
                        "deepseek_v4": tool_formats.V4,
                        "functiongemma": tool_formats.GEMMA[:2],
                        "minicpm5": ("<function", "</function>")}[parser]  # fmt: skip
    path = make_causal_lm(tmp_path / parser, specials=ST if parser == "step3" else ())
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": parser})  # fmt: skip
    tools_ = _strict("get_weather")
    tools_.append({"type": "function", "function": {"name": "note", "strict": True, "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}})  # fmt: skip
    (prep,) = runner.prepare_many([chat("t", tools=tools_)])
    strict = compiled(prep)

    def block(*calls: str) -> str:
        return f"Sure. {opening}\n{''.join(calls)}\n{closing} ok"

    weather = _typed_call(parser, "get_weather", {"unit": "c", "days": "3"})
    note = _typed_call(parser, "note", {"text": "a <b> & {c}, 5\nlines"})
    time = _typed_call(parser, "get_time", {"anything": "goes", "n": "5"})  # not strict
    for text in ("Plain.", block(weather), block(note), block(time)):
        assert _accepts(runner, strict, text), text
        types = param_types([Tool.model_validate(t) for t in tools_ + TOOLS[1:]])
        calls = read_calls(ToolUse("auto"), text, parser, types) or []
        # (minicpm5 drops the parameters get_time's schema lacks: its required zone is not
        # given, so the block is no call, as vLLM's)
        none = text == "Plain." or (parser == "minicpm5" and text == block(time))
        assert len(calls) == (0 if none else 1)
    weather_calls = read_calls(ToolUse("auto"), block(weather), parser, types) or []
    assert json.loads(weather_calls[0]["function"]["arguments"]) == {"unit": "c", "days": 3}
    # each property at most once, in the schema's order, the required ones always
    assert _accepts(runner, strict, block(_typed_call(parser, "note", {})))
    for bad in ({"unit": "k", "days": "3"}, {"unit": "c", "days": "9"},
                {"unit": "c", "days": "three"}, {"city": "Paris"}, {"unit": "c"}, {"days": "3"},
                [("days", "3"), ("unit", "c")], [("unit", "c"), ("unit", "f"), ("days", "3")],
                [("unit", "c"), ("days", "3"), ("days", "4")]):  # fmt: skip
        assert not _accepts(runner, strict, block(_typed_call(parser, "get_weather", bad))), bad
    assert not _accepts(runner, strict, block(_typed_call(parser, "note", [("text", "a")] * 2)))
    assert not _accepts(runner, strict, block(_typed_call(parser, "get_moon", {})))
    if parser in (
        "minimax_m2",
        "step3",
        "deepseek_v32",
        "hy_v3",
        "dots",
        "deepseek_v4",
    ):  # several calls a block, unless not parallel
        assert _accepts(runner, strict, block(weather, note))
        (prep,) = runner.prepare_many([chat("o", tools=tools_, parallel_tool_calls=False)])
        assert not _accepts(runner, compiled(prep), block(weather, note))


@pytest.mark.parametrize("v11", [False, True])
def test_mistral_calls_are_held_by_its_tokens(v11: bool, tmp_path: Path) -> None:
    # [TOOL_CALLS] then a JSON array; with an [ARGS] token (v11 tokenizers), NAME[ARGS]{...}
    # after each [TOOL_CALLS]; the grammar names the tokens by id (<[id]>)
    specials = ("[TOOL_CALLS]", "[ARGS]") if v11 else ("[TOOL_CALLS]",)
    path = make_causal_lm(tmp_path / "mistral", specials=specials)
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**TINY_LM_OPTIONS, "tool_call_parser": "mistral"})  # fmt: skip
    (prep,) = runner.prepare_many([chat("m", tools=_strict("get_weather"))])
    strict = compiled(prep)
    if v11:
        one = '[TOOL_CALLS]get_weather[ARGS]{"unit": "c", "days": 2}'
        two = one + '[TOOL_CALLS]get_time[ARGS]{"zone": "x"}'
        bad = '[TOOL_CALLS]get_weather[ARGS]{"unit": "c", "days": 0}'
    else:
        one = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}]'
        two = one[:-1] + ', {"name": "get_time", "arguments": {"zone": "x"}}]'
        bad = one.replace('"days": 2', '"days": 0')
    assert _accepts(runner, strict, "Sure, no call.")
    assert _accepts(runner, strict, f"Sure. {two}")
    calls = read_calls(ToolUse("auto"), f"Sure. {two}", "mistral") or []
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert not _accepts(runner, strict, bad)
    assert not _accepts(runner, strict, "[TOOL_CALLS] sunny")
    (prep,) = runner.prepare_many([chat("o", tools=_strict("get_weather"),
                                        parallel_tool_calls=False)])  # fmt: skip
    assert not _accepts(runner, compiled(prep), two)
    assert _accepts(runner, compiled(prep), one)
