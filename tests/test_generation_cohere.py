"""Cohere Command's modes (the ``cohere_command3`` and ``cohere_command4`` reasoning and
tool parsers, vLLM's, which hand the text to Cohere's melody filter): the reasoning is the
thinking parts, the content the answer parts without citations' tags, the calls the
action parts' JSON lists; streamed, each piece is a start of the result's, split at every
character. The cases mirror vLLM's ``test_cohere_command_tool_parser.py`` and melody's
options; texts are given to the runner's own delta code (a random model writes no
Command)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")

from batchfleet.schemas.tools import ToolUse  # noqa: E402
from batchfleet.worker.generation import cohere  # noqa: E402
from batchfleet.worker.generation.reasoning import CohereReasoning, reasoning_for  # noqa: E402
from batchfleet.worker.generation.split import OutputSplit  # noqa: E402
from batchfleet.worker.generation.tool_chunks import CallChunks  # noqa: E402
from batchfleet.worker.generation.tools import PARSERS, CallReader  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_reasoning import compiled, generate  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

THINK, END_THINK = cohere.START_THINKING, cohere.END_THINKING
ACT, END_ACT = cohere.START_ACTION, cohere.END_ACTION
SINGLE = (f"{THINK} i will call foo with query1{END_THINK}{ACT}\n[\n"
          '    {"tool_call_id": "0", "tool_name": "foo", "parameters": {"query": "query1"}}\n'
          f"]\n{END_ACT}")  # fmt: skip
MULTI = (f"{THINK}first I think about foo{END_THINK}{ACT}\n[\n"
         '    {"tool_call_id": "0", "tool_name": "foo", "parameters": {"query": "query1"}},\n'
         '    {"tool_call_id": "1", "tool_name": "bar", "parameters": {"x": 42}}\n'
         f"]\n{END_ACT}")  # fmt: skip
CITATIONS = (f"{THINK}This is a rainbow <co>emoji: 🌈</co: 0:[1]>{END_THINK}\n"
             "<|START_{tag}|>foo <co>bar</co: 0:[1,2],1:[3,4]><|END_{tag}|>")  # fmt: skip
FOO = ("0", "foo", '{"query":"query1"}')

VLLM_CASES = [
    # text, reasoning, content, calls (id, name, arguments): vLLM's table, both variants
    (SINGLE, "i will call foo with query1", "", [FOO]),
    (CITATIONS, "This is a rainbow emoji: 🌈", "foo bar", []),
    (MULTI, "first I think about foo", "", [FOO, ("1", "bar", '{"x":42}')]),
    (f"{THINK}just think, no response{END_THINK}", "just think, no response", "", []),
]
OWN_CASES = [
    # parser, thinking (the prompt's end), text, reasoning, content, calls
    ("cohere_command3", None, " Hello there. ", None, "Hello there.", []),  # the answer
    ("cohere_command4", None, "Still thinking", "Still thinking", "", []),  # cut thinking
    ("cohere_command4", None, f"Plan.{END_THINK}<|START_TEXT|>Done.<|END_TEXT|>", "Plan.",
     "Done.", []),  # its prompt opened the reasoning
    ("cohere_command4", False, "Straight away.", None, "Straight away.", []),
    ("cohere_command3", True, f"Hmm.{END_THINK}<|START_RESPONSE|>Yes.", "Hmm.", "Yes.", []),
    # text after an end marker is ignored, up to the next marker
    ("cohere_command3", None, "<|START_RESPONSE|>Answer.<|END_RESPONSE|> junk", None,
     "Answer.", []),
    # every marker switches: a call written while thinking is a call; thinking again
    ("cohere_command3", None, f"{THINK}plan {ACT}[" + '{"tool_call_id": "7", "tool_name": '
     '"bar", "parameters": {}}]' + f"{END_ACT}{THINK} more{END_THINK}ok", "planmore", "ok",
     [("7", "bar", "{}")]),
    # each answer part trimmed at its right, as melody drops the space before a marker
    ("cohere_command4", False, "a  <|START_TEXT|> b <|END_TEXT|>", None, "a b", []),
    # a citation the text cuts keeps its text; a closing tag alone, and <code>, are text
    ("cohere_command3", None, "see <co>doc", None, "see doc", []),
    ("cohere_command3", None, "a </co: 1:[2]> <code>x</code> <co: 0:[1]>y</co: 0:[1]>", None,
     "a </co: 1:[2]> <code>x</code> y", []),
    # a call that is not JSON, or no call: none; one without an id gets one
    ("cohere_command3", None, f"{ACT}[" + '{"tool_call_id": "0", "tool_name": "f", '
     '"parameters": {"a": }]' + END_ACT, None, "", []),
    ("cohere_command3", None, f"{ACT}[" + '{"tool_name": "f", "parameters": {"a": [1]}}, '
     '{"tool_call_id": "1", "tool_name": "", "parameters": {}}]', None, "",
     [(None, "f", '{"a":[1]}')]),
    # two action parts, the answer between them
    ("cohere_command3", None, f"{ACT}[" + '{"tool_call_id": "0", "tool_name": "f", '
     '"parameters": {"k": "v"}}]' + f"{END_ACT}<|START_RESPONSE|>between<|END_RESPONSE|>"
     f"{ACT}[" + '{"tool_call_id": "1", "tool_name": "g", "parameters": {"n": 1.5}}]', None,
     "between", [("0", "f", '{"k":"v"}'), ("1", "g", '{"n":1.5}')]),
]  # fmt: skip
CASES = [(p, None, text.replace("{tag}", tag), *rest)
         for p, tag in (("cohere_command3", "RESPONSE"), ("cohere_command4", "TEXT"))
         for text, *rest in VLLM_CASES] + OWN_CASES  # fmt: skip


def _split(parser: str, thinking: bool | None, use: ToolUse | None = None) -> OutputSplit:
    split = OutputSplit(reasoning_for(parser), thinking, False, cohere=cohere.FORMATS[parser])
    if use is not None:
        split.calls = CallReader(use, parser)
        split.chunks = CallChunks(split.calls, use, parser)
    return split


def _stream(split: OutputSplit, pieces: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``pieces`` released one after another: the deltas, and the result."""
    deltas, released = [], ""
    for piece in pieces:
        released += piece
        deltas.append(split.delta(released, piece, None))
    deltas.append(split.delta(released, "", released))
    return deltas, split.result(released)


def _added(deltas: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for c in (c for d in deltas for c in d.get("tool_call_chunks", ())):
        fn = c["function"]
        if "id" in c:
            calls[c["index"]] = {"id": c["id"], "type": c["type"],
                                 "function": {"name": fn["name"], "arguments": ""}}  # fmt: skip
        calls[c["index"]]["function"]["arguments"] += fn["arguments"]
    return calls


def _made(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with the call ids made here (not the model's) alike."""
    calls = [{**c, "id": "call_" if c["id"].startswith("call_") else c["id"]}
             for c in result.get("tool_calls", ())]  # fmt: skip
    return {**result, "tool_calls": calls}


def _tokens(text: str) -> list[str]:
    """``text`` as a model writes it: a marker whole, other text a character at a time."""
    return [p for part in re.split("(<\\|[A-Z_]+\\|>)", text) if part
            for p in ([part] if part in cohere.TOKENS else list(part))]  # fmt: skip


@pytest.mark.parametrize(("parser", "thinking", "text", "reasoning", "content", "calls"), CASES)
def test_command_texts_split_whole_and_streamed(
    parser: str, thinking: bool | None, text: str, reasoning: str | None, content: str,
    calls: list[tuple[str | None, str, str]],
) -> None:  # fmt: skip
    got = _split(parser, thinking, ToolUse("auto")).result(text)
    assert got.get("reasoning_content") == reasoning
    assert got["content"] == content
    made = [(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in got.get("tool_calls", ())]  # fmt: skip
    assert [(None if i is None else m[0], *m[1:]) for i, m in zip(
        [c[0] for c in calls], made, strict=True)] == calls  # fmt: skip
    assert all(m[0].startswith("call_") for c, m in zip(calls, made, strict=True) if c[0] is None)
    # streamed a character at a time, or a marker whole (the markers not special tokens,
    # or special): the pieces add up to the result, and the calls' chunks to its calls
    for pieces in (list(text), _tokens(text)):
        deltas, whole = _stream(_split(parser, thinking, ToolUse("auto")), pieces)
        assert _made(whole) == _made(got)  # (a call's id made here: another)
        for key in ("reasoning_content", "content"):
            assert "".join(d[key] for d in deltas) == whole.get(key, "")
        assert not any("<|" in d["reasoning_content"] + d["content"] for d in deltas)
        made = whole.get("tool_calls", [])
        assert [c for d in deltas for c in d.get("tool_calls", ())] == made
        streamed = list(_added(deltas).values())
        if ": }" in text:  # a call begun, then not one: streamed, left out of the result
            streamed = [c for c in streamed if c in made]
        assert streamed == made


@pytest.mark.parametrize("text", [SINGLE, MULTI])
def test_every_prefix_shows_a_start_of_the_whole(text: str) -> None:
    # text cut anywhere (a marker or a citation's tag half written too): what it shows is
    # a start of what the whole shows, and its calls the first of the whole's
    for parser in cohere.FORMATS:
        fmt = cohere.FORMATS[parser]
        mode = cohere.begins(fmt, None)
        reasoning = cohere.reasoning(text, fmt, mode, True) or ""
        content = cohere.content(text, fmt, mode, True)
        calls = cohere.calls(text, True)
        for n in range(len(text) + 1):
            cut = text[:n]
            assert reasoning.startswith(cohere.reasoning(cut, fmt, mode, False) or "")
            assert content.startswith(cohere.content(cut, fmt, mode, False))
            assert calls[: len(cohere.calls(cut, False))] == cohere.calls(cut, False)


def test_citations_so_far_hold_back_a_tag_being_written() -> None:
    assert cohere.uncite("a <co", False) == "a " and cohere.uncite("a <co", True) == "a <co"
    assert cohere.uncite("<co>x</co: 0:[", False) == "x"
    assert cohere.uncite("<co>x</co: 0:[1]> y", False) == "x y"
    assert cohere.uncite("a <c d", False) == "a <c d"  # not a tag: shown
    long = "<co: " + "1" * 65
    assert cohere.uncite(long, False) == long  # longer than a tag's: text


def test_parallel_tool_calls_false_reads_the_first() -> None:
    got = _split("cohere_command3", None, ToolUse("auto", parallel=False)).result(MULTI)
    assert [c["function"]["name"] for c in got["tool_calls"]] == ["foo"]


def test_the_prompt_end_tells_where_the_text_begins() -> None:
    cmd3, cmd4 = CohereReasoning("cohere_command3"), CohereReasoning("cohere_command4")
    assert cmd4.opens("<|CHATBOT_TOKEN|><|START_THINKING|>") is True
    assert cmd3.opens("<|CHATBOT_TOKEN|><|START_RESPONSE|>\n") is False
    assert cmd3.opens("<|START_TEXT|>") is None and cmd4.opens("<|START_TEXT|>") is False
    assert cmd3.opens("<|CHATBOT_TOKEN|>") is None  # the format's own start
    assert cohere.begins(cmd3.format, None) == cohere.ANSWER
    assert cohere.begins(cmd4.format, None) == cohere.THINKING
    assert {"cohere_command3", "cohere_command4"} <= set(PARSERS)


TEMPLATE = ("{% for m in messages %}<|START_OF_TURN_TOKEN|>{{ m['role'] }}{{ m['content'] }}"
            "<|END_OF_TURN_TOKEN|>{% endfor %}{% if add_generation_prompt %}"
            "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def command(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose tokenizer has Command's special tokens (``<|END_OF_TURN_TOKEN|>``
    ends a sequence) and a Command-like chat template."""
    specials = (*cohere.TOKENS, "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
                "<|CHATBOT_TOKEN|>")  # fmt: skip
    return make_causal_lm(tmp_path_factory.mktemp("tiny-command"), specials=specials,
                          eos_tokens=("<|END_OF_TURN_TOKEN|>",), template=TEMPLATE)  # fmt: skip


def _runner(path: Path, parser: str, **more: str) -> TextGenerationRunner:
    options = {**TINY_LM_OPTIONS, "reasoning_parser": parser, "tool_call_parser": parser, **more}
    return TextGenerationRunner(path, device=DEVICE, dtype="float32", options=options)


@pytest.fixture(scope="module")
def cmd3(command: Path) -> TextGenerationRunner:
    return _runner(command, "cohere_command3")


@pytest.fixture(scope="module")
def cmd4(command: Path) -> TextGenerationRunner:
    return _runner(command, "cohere_command4")


CALL = ('[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
        '{"unit": "c", "days": 2}}]')  # fmt: skip
WEATHER = {"id": "0", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"unit":"c","days":2}'}}  # fmt: skip


def test_a_command_call_streams_as_the_result_holds_it(cmd3: TextGenerationRunner) -> None:
    text = f"{THINK}The user wants the weather.{END_THINK}{ACT}{CALL}{END_ACT}"
    chunks, out = generate(cmd3, "w", [*_tokens(text), "<|END_OF_TURN_TOKEN|>"], stream=True)
    assert out["text"] == text == "".join(c["text"] for c in chunks)  # the markers kept
    assert out["reasoning_content"] == "The user wants the weather."
    assert out["content"] == "" and out["tool_calls"] == [WEATHER]
    for key in ("reasoning_content", "content"):
        assert "".join(c[key] for c in chunks) == out[key]
    assert _added(chunks) == {0: WEATHER}  # its name, then its arguments piece by piece
    assert len([c for ch in chunks for c in ch.get("tool_call_chunks", ())]) > 10
    # the whole call comes with the piece that closed its object, before the end
    streamed = [k for k, c in enumerate(chunks) if c.get("tool_calls")]
    assert len(streamed) == 1 and streamed[0] < len(chunks) - 2


def test_a_command4_answer_begins_in_its_reasoning(cmd4: TextGenerationRunner) -> None:
    text = "Simple: <co>Paris</co: 0:[1]>.<|END_THINKING|><|START_TEXT|>It is Paris.<|END_TEXT|>"
    for tools in (None, "default"):
        kw: dict[str, Any] = {"tools": None} if tools is None else {}
        chunks, out = generate(cmd4, f"a{tools}", [*_tokens(text), "<|END_OF_TURN_TOKEN|>"],
                               stream=True, **kw)  # fmt: skip
        assert (out["reasoning_content"], out["content"]) == ("Simple: Paris.", "It is Paris.")
        assert "tool_calls" not in out
        for key in ("reasoning_content", "content"):
            assert "".join(c[key] for c in chunks) == out[key]
        # the reasoning streams as it is written, before the answer's first piece
        said = [(c["reasoning_content"], c["content"]) for c in chunks]
        shown = next(k for k, (_, c) in enumerate(said) if c)
        assert "".join(r for r, _ in said[:shown]) == out["reasoning_content"]
        assert len([r for r, _ in said[:shown] if r]) > 8
    _, whole = generate(cmd4, "b", [*_tokens(text), "<|END_OF_TURN_TOKEN|>"], tools=None)
    assert (whole["reasoning_content"], whole["content"]) == ("Simple: Paris.", "It is Paris.")


def test_command_options(command: Path) -> None:
    r = _runner(command, "cohere_command4", tool_call_parser="cohere_command3")
    assert r.info()["reasoning_parser"] == "cohere_command4"
    assert r._cohere is cohere.FORMATS["cohere_command4"]  # the reasoning parser's
    # the tool parser alone: an answer's content is still its answer parts
    r = _runner(command, "cohere_command4")
    r2 = TextGenerationRunner(command, device=DEVICE, dtype="float32",
                              options={**TINY_LM_OPTIONS, "tool_call_parser": "cohere_command4"})  # fmt: skip
    assert r2.info()["reasoning_parser"] is None and r2._cohere is r._cohere
    split = OutputSplit(None, None, False, cohere=r2._cohere)
    assert split.result("x<|END_THINKING|><|START_TEXT|>y") == {"content": "y"}
    # ... and its markers are kept in the text, the calls tool_choice asks for read as
    # Command writes them
    text = f"Weather.{END_THINK}{ACT}{CALL}{END_ACT}"
    chunks, out = generate(r2, "t", [*_tokens(text), "<|END_OF_TURN_TOKEN|>"], stream=True,
                           tool_choice="required")  # fmt: skip
    assert out["text"] == text and out["tool_calls"] == [WEATHER] and out["content"] == ""
    assert "reasoning_content" not in out and _added(chunks) == {0: WEATHER}


def _accepts(runner: TextGenerationRunner, sampling: Any, text: str) -> bool:
    m = sampling.constraint.matcher()
    ids = runner.tokenizer.encode(text, add_special_tokens=False)
    return bool(m.consume_tokens(ids) and m.is_accepting())


def test_command_writes_the_calls_tool_choice_asks_for_as_its_calls_part(
    cmd3: TextGenerationRunner, cmd4: TextGenerationRunner
) -> None:
    # vLLM's structural tag's aim: the reasoning free, then <|START_ACTION|> and a list of
    # calls whose parameters follow the functions' schemas
    from test_generation_runner import run
    from test_generation_tools import chat

    (prep,) = cmd3.prepare_many([chat("r", tool_choice="required")])
    spec = prep.payload  # type: ignore[union-attr]
    assert spec.reasoning and spec.sampling.constraint_after is None  # split, from the first
    required = compiled(prep)
    time = '{"tool_call_id":"1","tool_name":"get_time","parameters":{"zone":"cet"}}'
    weather = '{"tool_call_id":"0","tool_name":"get_weather","parameters":{"unit":"c","days":2}}'
    thought = f"{THINK}Which <tool>? Both.{END_THINK}"
    bad_id = time.replace('"1"', '"x"')
    for text in (f"{thought}{ACT}[{weather},{time}]{END_ACT}", f"{ACT}[{time}]{END_ACT}"):
        assert _accepts(cmd3, required, text), text
    for text in (
        f"{ACT}[{time.replace('cet', 'mars')}]{END_ACT}",  # its schema
        f"{ACT}[ {time}]{END_ACT}",  # compact
        f"{ACT}[{time.replace('get_time', 'get_date')}]{END_ACT}",
        f"{ACT}[{bad_id}]{END_ACT}",  # a numeric id
        f"{thought}<|START_RESPONSE|>No call.",  # a call it must make
        f"Which?{END_THINK}{ACT}[{time}]{END_ACT}",  # cmd3 begins in its answer
    ):
        assert not _accepts(cmd3, required, text), text
    named = {"type": "function", "function": {"name": "get_time"}}
    (prep,) = cmd3.prepare_many([chat("n", tool_choice=named)])
    only = compiled(prep)
    assert _accepts(cmd3, only, f"{ACT}[{time}]{END_ACT}")
    assert not _accepts(cmd3, only, f"{ACT}[{weather}]{END_ACT}")
    assert not _accepts(cmd3, only, f"{ACT}[{time},{time}]{END_ACT}")  # one call
    # Command 4 begins in its reasoning: no <|START_THINKING|>
    (prep,) = cmd4.prepare_many([chat("4", tool_choice="required")])
    four = compiled(prep)
    assert _accepts(cmd4, four, f"Which? Time.{END_THINK}{ACT}[{time}]{END_ACT}")
    assert not _accepts(cmd4, four, f"{ACT}[{time}]{END_ACT}")
    # generated: kept from thinking, the random model's call is the named function's
    tok = cmd3.tokenizer
    no_think = {str(tok.convert_tokens_to_ids(THINK)): -100.0}
    outs = run(cmd3, chat("g", tool_choice=named, logit_bias=no_think, max_new_tokens=80))
    (out,) = outs["g"]
    assert out["text"].startswith(f"{ACT}[") and out["finish_reason"] == "stop", out
    (call,) = out["tool_calls"]
    assert call["function"]["name"] == "get_time" and call["id"].isdigit()
    assert json.loads(call["function"]["arguments"]) in ({"zone": "utc"}, {"zone": "cet"})
    assert out["content"] == "" and out.get("reasoning_content") is None
    # streamed, required: the reasoning, then the call's chunks, adding up to the result's
    text = f"{thought}{ACT}[{time}]{END_ACT}"
    chunks, out = generate(cmd3, "s", [*_tokens(text), "<|END_OF_TURN_TOKEN|>"], stream=True,
                           tool_choice="required")  # fmt: skip
    assert out["reasoning_content"] == "Which <tool>? Both." and out["content"] == ""
    (call,) = out["tool_calls"]
    assert call == {"id": "1", "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone":"cet"}'}}  # fmt: skip
    assert _added(chunks) == {0: call}


def test_a_constrained_command_answer_is_constrained_after_its_marker(
    cmd3: TextGenerationRunner, cmd4: TextGenerationRunner
) -> None:
    from test_generation_tools import chat

    for runner, marker in ((cmd3, "<|START_RESPONSE|>"), (cmd4, "<|START_TEXT|>")):
        (prep,) = runner.prepare_many(
            [chat("c", tools=None, structured_outputs={"regex": "[0-9]{3}"})]
        )
        spec = prep.payload  # type: ignore[union-attr]
        after = spec.sampling.constraint_after
        assert spec.reasoning and after is not None
        assert after.head == (runner.tokenizer.convert_tokens_to_ids(marker),)
        assert spec.sampling.constraint_unless is None  # it waits for the marker


def test_command_strict_functions_hold_its_calls_not_its_modes(
    cmd3: TextGenerationRunner,
) -> None:
    from test_generation_strict_calls import _strict
    from test_generation_tools import chat

    (prep,) = cmd3.prepare_many([chat("a", tools=_strict("get_weather"))])
    spec = prep.payload  # type: ignore[union-attr]
    assert spec.reasoning and spec.sampling.constraint_after is None  # held from the first
    strict = compiled(prep)
    weather = '{"tool_call_id":"0","tool_name":"get_weather","parameters":{"unit":"c","days":1}}'
    other = '{"tool_call_id":"1","tool_name":"get_time","parameters":{"any":[1]}}'
    bad_unit = weather.replace('"unit":"c"', '"unit":"k"')
    for text in (
        f"{THINK}Think.{END_THINK}<|START_RESPONSE|>Answer.<|END_RESPONSE|>",  # no call
        f"{THINK}x{END_THINK}{ACT}[{weather},{other}]{END_ACT}<|START_RESPONSE|>ok",
        f"{ACT}[{other}]{END_ACT}{ACT}[{weather}]{END_ACT}",  # not strict: any object
    ):
        assert _accepts(cmd3, strict, text), text
    for text in (
        f"{ACT}[{bad_unit}]{END_ACT}",  # its schema
        f"{ACT}[ {weather}]{END_ACT}",  # compact
        f"{ACT}[{weather.replace('get_weather', 'get_moon')}]{END_ACT}",
        f"{ACT}free text{END_ACT}",
    ):
        assert not _accepts(cmd3, strict, text), text
    # one call at most without parallel calls
    (prep,) = cmd3.prepare_many(
        [chat("p", tools=_strict("get_weather"), parallel_tool_calls=False)]
    )
    one = compiled(prep)
    assert _accepts(cmd3, one, f"{ACT}[{weather}]{END_ACT}<|START_RESPONSE|>Done.")
    assert not _accepts(cmd3, one, f"{ACT}[{weather},{other}]{END_ACT}")
    assert not _accepts(cmd3, one, f"{ACT}[{weather}]{END_ACT}{ACT}[{other}]{END_ACT}")
    # no strict function: free
    (prep,) = cmd3.prepare_many([chat("f")])
    assert prep.payload.compiling is None and prep.payload.sampling.constraint is None  # type: ignore[union-attr]
