"""The message-block formats (vLLM's ``inkling`` and ``muse_glimmer`` reasoning and tool
parsers): reasoning, answer and call blocks in any order. Each text is read whole, then
streamed a character at a time and a marker (special token) whole: the pieces add up to
the result, and the calls' chunks to its calls; cut anywhere, a text shows a start of what
the whole shows. The cases follow vLLM's parsers' rules (see the modules); texts are given
to the runner's own delta code (a random model writes neither format)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.tools import ToolUse  # noqa: E402
from batchfleet.worker.generation import blocks, inkling, muse_glimmer  # noqa: E402
from batchfleet.worker.generation.reasoning import REASONING_PARSERS, reasoning_for  # noqa: E402
from batchfleet.worker.generation.split import OutputSplit  # noqa: E402
from batchfleet.worker.generation.tool_chunks import CallChunks  # noqa: E402
from batchfleet.worker.generation.tools import PARSERS, CallReader  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_cohere import _added, _made, _stream  # noqa: E402
from test_generation_reasoning import generate  # noqa: E402
from test_generation_tools import chat  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

MM, TEXT, THINK, END = inkling.MESSAGE_MODEL, inkling.TEXT, inkling.THINKING, inkling.END
TOOL = inkling.TOOL_JSON
WEATHER = '{"name": "get_weather", "args": {"city": "SF", "days": 2}}'
W_ARGS = '{"city":"SF","days":2}'
INKLING = [
    # thinking (the prompt's end), text, reasoning, content, calls (name, arguments)
    (None, f"{THINK}Let me think. \n{END}{MM}{TOOL}{WEATHER}{END}{MM}{TEXT}Done.{END}",
     "Let me think.", "Done.", [("get_weather", W_ARGS)]),
    (None, f"{TEXT}Hello there.{END}", None, "Hello there.", []),
    # the prompt opened the reasoning, or the answer
    (True, f"plan it \n{END}{MM}{TEXT}ok", "plan it", "ok", []),
    (False, "Straight away.", None, "Straight away.", []),
    # a header's text: left out before a block's marker, the answer before an end
    (None, f"get_weather{TOOL}{WEATHER}{END}", None, "", [("get_weather", W_ARGS)]),
    (None, f"hi{END}{MM}{TEXT} there", None, "hi there", []),
    (None, "no markers at all", None, "no markers at all", []),
    # blocks in any order, reasoning again after the answer; the end of sampling ends one
    (None, f"{TEXT}A.{END}{MM}{THINK}more {inkling.END_SAMPLING}{MM}{THINK}again{END}",
     "moreagain", "A.", []),
    # a call opened while thinking ends the reasoning
    (True, f"think {TOOL}{WEATHER}{END}", "think", "", [("get_weather", W_ARGS)]),
    # a marker with no move where it stands is text: the answer's in the reasoning
    (True, f"a{TEXT}b{END}{TEXT}c", f"a{TEXT}b", "c", []),
    # raw and error tool blocks show as text
    (None, f"{inkling.TOOL_TEXT}raw call{END}{MM}{inkling.TOOL_ERROR} oops", None,
     "raw call oops", []),
    # two calls, "arguments" (a JSON string too) or none; whitespace only is no content
    (None, f"{TOOL}" + '{"name": "f", "arguments": {"a": [1, {"b": null}]}}' + f"{END}\n{MM}"
     f"{TOOL}" + '{"name": "g", "arguments": "{\\"x\\": 1}"}' + f"{END}\n{MM}{TOOL}"
     '{"name": "h"}' + END, None, "",
     [("f", '{"a":[1,{"b":null}]}'), ("g", '{"x":1}'), ("h", "{}")]),
    # a block that is no call is content, as written
    (None, f"{TOOL}" + '{"name": "f", "args": [1]}' + f"{END}{MM}{TEXT}!", None,
     '{"name": "f", "args": [1]}!', []),
    (None, f"{TOOL}" + '{"name": "f", "args": {"a": }' + END, None, '{"name": "f", "args": {"a": }',
     []),
    (None, f"{TOOL}" + '{"args": {}}' + END, None, '{"args": {}}', []),
    (None, f"{TOOL}" + '{"name": "f", "args": {"a": 1' , None, '{"name": "f", "args": {"a": 1',
     []),  # cut
]  # fmt: skip
S, E, Q = muse_glimmer.START, muse_glimmer.EOM, muse_glimmer.EOT
INVOKE = ('<atem:function_calls>\n<atem:invoke name="{name}">\n<atem:parameter name="city">'
          'Paris</atem:parameter>\n<atem:parameter name="days">3</atem:parameter>\n'
          '<atem:parameter name="opts">{{"a": [1]}}</atem:parameter>\n</atem:invoke>\n'
          "</atem:function_calls>")  # fmt: skip
M_ARGS = '{"city":"Paris","days":3,"opts":{"a":[1]}}'
MUSE = [
    (None, f" to=self<|message|>Think.{E}{S}assistant to=get_weather.get_weather<|message|>"
     + INVOKE.format(name="get_weather.get_weather") + f"{E}{S}assistant to=user<|message|>"
     f"Here.{Q}", "Think.", "Here.", [("get_weather", M_ARGS)]),
    (None, "Just text, no framing.", None, "Just text, no framing.", []),
    # reasoning blocks one after the other, as vLLM's engine-based parser joins them whole
    # and streamed; the answer's too, as written
    (None, f" to=self<|message|>one{E}{S}assistant to=self<|message|>two{E}{S}assistant"
     f" to=user<|message|>A {E}{S}assistant<|message|>B{Q}", "onetwo", "A B", []),
    (None, f" to=self<|message|>A{E}{S}assistant to=self<|message|>B{E}{S}assistant"
     f" to=user<|message|>C{Q}", "AB", "C", []),  # vLLM's test, the same
    # a header may follow a body with no end marker (its spaces and recipient held back)
    (None, " to=self<|message|>one to=user<|message|>two\nto=self<|message|>three", "onethree",
     "two\n", []),
    # a "to=" in prose is no header (vLLM's tests); a bare header's body is content
    (None, f" to=self<|message|>set flag to=5 and send it to=alice{E}{S}assistant"
     f" to=user<|message|>done{Q}", "set flag to=5 and send it to=alice", "done", []),
    (None, f" <|message|>public text{Q}", None, "public text", []),
    # vLLM's engine tests: a reasoning cut short keeps the call it echoes, and makes none;
    # one left open before a bare tool header does not swallow the call
    (None, ' to=self<|message|>Maybe <atem:invoke name="f"></atem:invoke> but wait',
     'Maybe <atem:invoke name="f"></atem:invoke> but wait', "", []),
    (None, " to=self<|message|>calling now to=weather.get<|message|>"
     + INVOKE.format(name="weather.get"), "calling now", "", [("weather.get", M_ARGS)]),
    # a reasoning block left open does not swallow the call after it
    (None, f" to=self<|message|>hmm{S}assistant to=f.g<|message|>"
     '<atem:invoke name="f.g"></atem:invoke>' + E, "hmm", "", [("f.g", "{}")]),
    # a call echoed in the reasoning or the answer is none (the answer shows it)
    (None, f' to=self<|message|>maybe <atem:invoke name="f"></atem:invoke>{E}{S}assistant'
     f' to=user<|message|>No <atem:invoke name="f"></atem:invoke>{Q}',
     'maybe <atem:invoke name="f"></atem:invoke>', 'No <atem:invoke name="f"></atem:invoke>',
     []),
    # a name doubled over is the request's function; another is as written
    (None, " to=weather.get<|message|>" + INVOKE.format(name="weather.get") + E, None, "",
     [("weather.get", M_ARGS)]),
    # no framing at all: calls read from all of it (the content too)
    (None, INVOKE.format(name="get_weather"), None, INVOKE.format(name="get_weather"),
     [("get_weather", M_ARGS)]),
    # malformed: an invoke without a name, or cut, makes no call
    (None, f" to=f<|message|><atem:invoke>x</atem:invoke>{E}{S}assistant to=user<|message|>"
     "ok", None, "ok", []),
    (None, ' to=f<|message|><atem:invoke name="f"><atem:parameter name="a">1', None, "", []),
]  # fmt: skip
CASES = [("inkling", *c) for c in INKLING] + [("muse_glimmer", *c) for c in MUSE]
TYPES = {"get_weather": {"city": "string", "days": "integer"}, "f": {}, "calendar.get": {}}
_MARKER = re.compile("(" + "|".join(map(re.escape, inkling.TOKENS + muse_glimmer.TOKENS)) + ")")


def _split(parser: str, thinking: bool | None, use: ToolUse | None = None,
           reasoning: bool = True) -> OutputSplit:  # fmt: skip
    fmt = blocks.FORMATS[parser]
    split = OutputSplit(reasoning_for(parser) if reasoning else None, thinking, False,
                        blocks=fmt)  # fmt: skip
    if use is not None:
        split.calls = CallReader(use, parser, TYPES)
        split.chunks = CallChunks(split.calls, use, parser, TYPES)
    return split


def _tokens(text: str) -> list[str]:
    """``text`` as a model writes it: a marker whole, other text a character at a time."""
    return [p for part in _MARKER.split(text) if part
            for p in ([part] if _MARKER.fullmatch(part) else list(part))]  # fmt: skip


@pytest.mark.parametrize(("parser", "thinking", "text", "reasoning", "content", "calls"), CASES)
def test_block_texts_split_whole_and_streamed(
    parser: str, thinking: bool | None, text: str, reasoning: str | None, content: str,
    calls: list[tuple[str, str]],
) -> None:  # fmt: skip
    got = _split(parser, thinking, ToolUse("auto")).result(text)
    assert got.get("reasoning_content") == reasoning
    assert got["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in got.get("tool_calls", ())] == calls  # fmt: skip
    for pieces in (list(text), _tokens(text)):
        deltas, whole = _stream(_split(parser, thinking, ToolUse("auto")), pieces)
        assert _made(whole) == _made(got)
        for key in ("reasoning_content", "content"):
            assert "".join(d[key] for d in deltas) == whole.get(key, "")
        made = whole.get("tool_calls", [])
        assert [c for d in deltas for c in d.get("tool_calls", ())] == made
        streamed = list(_added(deltas).values())
        if not made:  # a call begun, then none (cut, or not JSON): left out of the result
            streamed = [c for c in streamed if c in made]
        assert streamed == made


@pytest.mark.parametrize(("parser", "thinking", "text"), [c[:3] for c in CASES])
def test_every_prefix_shows_a_start_of_the_whole(
    parser: str, thinking: bool | None, text: str
) -> None:
    fmt = blocks.FORMATS[parser]
    reasoning = fmt.reasoning(text, thinking, True) or ""
    content = fmt.content(text, thinking, True)
    calls = fmt.read_calls(text, True, TYPES)
    for n in range(len(text) + 1):
        cut = text[:n]
        assert reasoning.startswith(fmt.reasoning(cut, thinking, False) or "")
        assert content.startswith(fmt.content(cut, thinking, False))
        assert calls[: len(fmt.read_calls(cut, False, TYPES))] == fmt.read_calls(cut, False, TYPES)


def test_inkling_streams_a_calls_arguments_as_written() -> None:
    text = f"{TOOL}{WEATHER}{END}"
    deltas, whole = _stream(_split("inkling", None, ToolUse("auto")), list(text))
    pieces = [c for d in deltas for c in d.get("tool_call_chunks", ())]
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(pieces) > 10  # its arguments piece by piece, before the block closed
    (call,) = whole["tool_calls"]
    streamed = [k for k, d in enumerate(deltas) if d.get("tool_calls")]
    first = next(k for k, d in enumerate(deltas) if d.get("tool_call_chunks"))
    assert first < streamed[0] and call["function"]["arguments"] == W_ARGS


def test_the_prompt_end_tells_where_an_inkling_text_begins() -> None:
    split = reasoning_for("inkling")
    assert split.opens(f"<|message_user|>hi{END}{MM}{THINK}") is True
    assert split.opens(f"{MM}{TEXT}") is False
    assert split.opens(f"{THINK}x{END}{MM}") is None  # a header
    assert split.opens("plain") is None
    assert reasoning_for("muse_glimmer").opens("<|start|>assistant") is None
    assert {"inkling", "muse_glimmer"} <= set(PARSERS) & set(REASONING_PARSERS)


def test_without_a_reasoning_parser_the_content_is_still_the_formats() -> None:
    text = f"{THINK}secret{END}{MM}{TEXT}shown{END}"
    assert _split("inkling", None, ToolUse("auto"), reasoning=False).result(text) == {
        "content": "shown"
    }


def test_parallel_tool_calls_false_reads_the_first() -> None:
    text = f"{TOOL}" + '{"name": "f", "args": {}}' + f"{END}{TOOL}" + '{"name": "g"}' + END
    got = _split("inkling", None, ToolUse("auto", parallel=False)).result(text)
    assert [c["function"]["name"] for c in got["tool_calls"]] == ["f"]


TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
            "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant"
            "{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def blocky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose tokenizer has both formats' special tokens (``<|end|>`` ends a
    sequence)."""
    specials = (*inkling.TOKENS, *muse_glimmer.TOKENS, "<|end|>")
    return make_causal_lm(tmp_path_factory.mktemp("tiny-blocks"), specials=specials,
                          eos_tokens=("<|end|>",), template=TEMPLATE)  # fmt: skip


def _runner(path: Path, parser: str, **more: Any) -> TextGenerationRunner:
    options = {**TINY_LM_OPTIONS, "reasoning_parser": parser, "tool_call_parser": parser, **more}
    return TextGenerationRunner(path, device=DEVICE, dtype="float32", options=options)


@pytest.mark.parametrize("parser", ["inkling", "muse_glimmer"])
def test_a_runner_splits_and_streams_a_block_text(blocky: Path, parser: str) -> None:
    _, text, reasoning, content, calls = (INKLING if parser == "inkling" else MUSE)[0]
    runner = _runner(blocky, parser)
    assert runner._blocks is blocks.FORMATS[parser]
    for choice in ("auto", "required"):  # written natively, whatever the choice
        chunks, out = generate(runner, f"{parser}{choice}", [*_tokens(text), "<|end|>"],
                               stream=True, tool_choice=choice)  # fmt: skip
        assert out["text"] == text == "".join(c["text"] for c in chunks)  # the markers kept
        assert (out["reasoning_content"], out["content"]) == (reasoning, content)
        made = [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]]
        assert made == calls
        for key in ("reasoning_content", "content"):
            assert "".join(c[key] for c in chunks) == out[key]
        assert list(_added(chunks).values()) == out["tool_calls"]
    # tool_choice required is not constrained (written natively, read as auto)
    (prep,) = runner.prepare_many([chat(f"{parser}c", tool_choice="required")])
    assert prep.payload.compiling is None and prep.payload.sampling.constraint is None
    # the tool parser alone: its content is still the format's, its reasoning left out
    alone = TextGenerationRunner(blocky, device=DEVICE, dtype="float32",
                                 options={**TINY_LM_OPTIONS, "tool_call_parser": parser})  # fmt: skip
    _, out = generate(alone, f"{parser}alone", [*_tokens(text), "<|end|>"])
    assert out["content"] == content and "reasoning_content" not in out
    assert [c["function"]["name"] for c in out["tool_calls"]] == [n for n, _ in calls]
