"""gpt-oss's harmony messages (the ``openai_gptoss`` reasoning parser and the ``openai``
tool parser, vLLM's): the reasoning is the analysis messages, the content the final
messages and preambles, the calls the messages to ``functions.NAME``; streamed, each piece
is a start of the result's. Texts are given to the runner's own delta code a token at a
time (a random model writes no harmony)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.tools import ToolUse  # noqa: E402
from batchfleet.worker.generation import harmony  # noqa: E402
from batchfleet.worker.generation.harmony import MESSAGE  # noqa: E402
from batchfleet.worker.generation.reasoning import HarmonyReasoning  # noqa: E402
from batchfleet.worker.generation.sampling import Marker, SeededSampler, _Track  # noqa: E402
from batchfleet.worker.generation.split import OutputSplit  # noqa: E402
from batchfleet.worker.generation.tools import CallReader  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_reasoning import generate  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

A = "<|channel|>analysis<|message|>"
NEXT = "<|start|>assistant"
FINAL = "<|channel|>final<|message|>"
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"

CASES = [
    # text, reasoning, content, calls (name, arguments)
    (f"{A}User asks. Easy.<|end|>{NEXT}{FINAL}Paris.<|return|>", "User asks. Easy.", "Paris.", []),
    (f"{A}Need weather.<|end|>{NEXT}{CALL}" + '{"city": "Paris", "days": 2}<|call|>',
     "Need weather.", "", [("get_weather", '{"city":"Paris","days":2}')]),
    # the recipient before the channel; a preamble for the user first
    (f"{A}Plan.<|end|>{NEXT}<|channel|>commentary<|message|>Checking the weather.<|end|>"
     f"{NEXT} to=functions.get_time<|channel|>commentary json<|message|>" + '{"zone": "utc"}',
     "Plan.", "Checking the weather.", [("get_time", '{"zone":"utc"}')]),
    (f"{FINAL} Straight to it. ", None, "Straight to it.", []),  # no reasoning
    (f"{A}Still thinking about", "Still thinking about", "", []),  # cut while thinking
    # two analysis messages, one to a built-in tool (the model's own business: reasoning)
    (f"{A}First.<|end|>{NEXT}<|channel|>analysis to=browser.search<|message|>" + '{"q": 1}'
     f"<|end|>{NEXT}{A}\n\n<|end|>{NEXT}{FINAL}Done", 'First.\n{"q": 1}', "Done", []),
    (f"{A}x<|end|>{NEXT}{CALL}" + '{"city": "Par', "x", "", []),  # a call cut: none
    # thinking again after a preamble: reasoning too, wherever it is (vLLM's)
    (f"{A}Plan.<|end|>{NEXT}<|channel|>commentary<|message|>One moment.<|end|>"
     f"{NEXT}{A} Rethink. <|end|>{NEXT}{FINAL}Sunny.<|return|>",
     "Plan.\nRethink.", "One moment.\nSunny.", []),
    (f"{FINAL}Hi.<|end|>{NEXT}{A}Was that right?", "Was that right?", "Hi.", []),
]  # fmt: skip


def _tokens(text: str) -> list[str]:
    """``text`` as a model writes it: a special token whole, other text a character at a
    time."""
    return [p for part in re.split("(<\\|[a-z]+\\|>)", text) if part
            for p in ([part] if part in harmony.TOKENS else list(part))]  # fmt: skip


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_harmony_texts_split_and_so_far(
    text: str, reasoning: str | None, content: str, calls: list[tuple[str, str]]
) -> None:
    split = HarmonyReasoning()
    got_reasoning, answer = split.split(text, split.opens("<|start|>assistant"))
    assert got_reasoning == reasoning
    reader = CallReader(ToolUse("auto"), "openai")
    reader.read(answer, final=True)
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in reader.calls]
    assert got == calls
    assert (reader.content if calls else split.content(answer)) == content
    # as it is written: every reasoning and content so far is a start of the whole's, and
    # where the answer begins is fixed once known
    pieces = _tokens(text)
    starts = set()
    for n in range(len(pieces) + 1):
        so_far = "".join(pieces[:n])
        assert (reasoning or "").startswith(split.so_far(so_far, None))
        start = split.answer_start(so_far, False, None)
        if start is not None:
            starts.add(start)
            assert content.startswith(reader.content_so_far(so_far[start:]))
    assert len(starts) <= 1


def test_messages_read_their_headers() -> None:
    text = f"{A}a<|end|>{NEXT} to=functions.f<|channel|>commentary json<|message|>{{}}<|call|>"
    first, second = harmony.messages(text)
    assert (first.channel, first.recipient, first.closed, first.reasoning) == (
        "analysis", None, True, True)  # fmt: skip
    assert (second.channel, second.call, second.closed) == ("commentary", "f", True)
    assert text[second.body : second.end] == "{}" and second.after == len(text)
    # where the tokens are not special, what may be an end token's start is held back
    (cut,) = harmony.messages(f"{A}abc<|en")
    assert (cut.closed, cut.end, harmony.reasoning(f"{A}abc<|en")) == (False, len(A) + 3, "abc")
    (writing,) = harmony.messages("<|channel|>fin")
    assert writing.body is None  # its header still being written: nothing known
    assert harmony.answer_start("<|channel|>fin", False) is None


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory: pytest.TempPathFactory) -> TextGenerationRunner:
    """A tiny model whose tokenizer has harmony's special tokens (``<|return|>`` and
    ``<|call|>`` end a sequence) and a harmony chat template."""
    template = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
                "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")  # fmt: skip
    path = make_causal_lm(tmp_path_factory.mktemp("tiny-gpt-oss"), specials=harmony.TOKENS,
                          eos_tokens=("<|return|>", "<|call|>"), template=template)  # fmt: skip
    options = {**TINY_LM_OPTIONS, "reasoning_parser": "openai_gptoss", "tool_call_parser": "openai"}
    return TextGenerationRunner(path, device=DEVICE, dtype="float32", options=options)


def _added(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for c in (c for ch in chunks for c in ch.get("tool_call_chunks", ())):
        fn = c["function"]
        if "id" in c:
            calls[c["index"]] = {"id": c["id"], "type": c["type"],
                                 "function": {"name": fn["name"], "arguments": ""}}  # fmt: skip
        calls[c["index"]]["function"]["arguments"] += fn["arguments"]
    return calls


def test_a_gpt_oss_call_streams_as_the_result_holds_it(gptoss: TextGenerationRunner) -> None:
    text = (f"{A}The user wants the weather. Call it.<|end|>{NEXT}<|channel|>commentary"
            "<|message|>Let me check.<|end|>"
            f"{NEXT}{CALL}" + '{"city": "Zürich", "unit": "c"}')  # fmt: skip
    chunks, out = generate(gptoss, "w", [*_tokens(text), "<|call|>"], stream=True)
    assert out["text"] == text == "".join(c["text"] for c in chunks)  # <|call|>: the end
    assert out["reasoning_content"] == "The user wants the weather. Call it."
    assert out["content"] == "Let me check."
    (call,) = out["tool_calls"]
    assert call["function"] == {"name": "get_weather",
                                "arguments": '{"city":"Zürich","unit":"c"}'}  # fmt: skip
    for key in ("reasoning_content", "content"):
        assert "".join(c[key] for c in chunks) == out[key]
    assert not any("<|" in c["reasoning_content"] + c["content"] for c in chunks)
    assert _added(chunks) == {0: call}  # the arguments piece by piece, the same id
    pieces = [c for ch in chunks for c in ch.get("tool_call_chunks", ())]
    assert len(pieces) > 10
    # the whole call comes once the text ends (<|call|> ends the generation)
    assert [k for k, c in enumerate(chunks) if c.get("tool_calls")] == [len(chunks) - 1]


def test_gpt_oss_reasoning_after_the_answer_began_streams_as_reasoning(
    gptoss: TextGenerationRunner,
) -> None:
    text = (f"{A}Need data.<|end|>{NEXT}<|channel|>commentary<|message|>Looking it up.<|end|>"
            f"{NEXT}{A}Rather answer directly.<|end|>{NEXT}{FINAL}It is 4.")  # fmt: skip
    for tools in (None, "default"):
        kw: dict[str, Any] = {"tools": None} if tools is None else {}
        chunks, out = generate(gptoss, f"i{tools}", [*_tokens(text), "<|return|>"],
                               stream=True, **kw)  # fmt: skip
        assert out["reasoning_content"] == "Need data.\nRather answer directly."
        assert out["content"] == "Looking it up.\nIt is 4."
        for key in ("reasoning_content", "content"):
            assert "".join(c[key] for c in chunks) == out[key]
        # the second thought streams as it is written, after the preamble's content
        said = [(c["reasoning_content"], c["content"]) for c in chunks]
        shown = next(k for k, (_, c) in enumerate(said) if c)
        assert "".join(r for r, _ in said[:shown]) == "Need data."
        assert "".join(r for r, _ in said[shown:]) == "\nRather answer directly."
        assert len([r for r, _ in said[shown:] if r]) > 10  # piece by piece


def test_a_gpt_oss_answer_without_tools(gptoss: TextGenerationRunner) -> None:
    text = f"{A}Simple.<|end|>{NEXT}{FINAL}The capital is Paris."
    chunks, out = generate(gptoss, "a", [*_tokens(text), "<|return|>"], stream=True, tools=None)
    assert (out["reasoning_content"], out["content"]) == ("Simple.", "The capital is Paris.")
    assert "tool_calls" not in out and out["text"] == text
    assert "".join(c["content"] for c in chunks) == out["content"]
    # not streamed: the same result
    _, whole = generate(gptoss, "b", [*_tokens(text), "<|return|>"], tools=None)
    assert (whole["reasoning_content"], whole["content"]) == ("Simple.", "The capital is Paris.")


def test_a_constrained_gpt_oss_chat_is_constrained_in_its_final_message(
    gptoss: TextGenerationRunner,
) -> None:
    # vLLM's way: free through the analysis messages and the final message's header
    # (<|channel|>final, up to 20 tokens, <|message|>), then the constraint
    from test_generation_reasoning import compiled
    from test_generation_tools import chat

    tok = gptoss.tokenizer

    def ids(text: str) -> list[int]:
        return [int(t) for t in tok.encode(text, add_special_tokens=False)]

    (prep,) = gptoss.prepare_many([chat("c", tools=None, structured_outputs={"regex": "[0-9]{3}"})])
    spec = prep.payload  # type: ignore[union-attr]
    marker = Marker(tuple(ids("<|channel|>final")), (tok.convert_tokens_to_ids(MESSAGE),), 20)
    assert spec.reasoning and spec.sampling.constraint_after == marker
    sampling = compiled(prep)
    for header in (FINAL, "<|channel|>final <|constrain|>json<|message|>"):
        out = ids(f"{A}Think: final answer?<|end|>{NEXT}{header}")
        # token by token, as drawn: the constraint begins with the header's last token
        sampler = SeededSampler()
        sampler.add("s", sampling, [1, 2])
        track = sampler._tracks["s"]
        for k, token in enumerate(out):
            assert track.matcher is None, k
            SeededSampler._consume("s", track, token)
        assert track.matcher is not None and not track.matcher.is_accepting()
        for token in ids("123"):
            SeededSampler._consume("s", track, token)
        assert track.matcher.is_accepting()
        # a resumed track takes it up where it was
        track.restart([1, 2, *out, *ids("12")])
        assert track.matcher is not None and not track.matcher.is_accepting()
        track.restart([1, 2, *out[:-1]])
        assert track.matcher is None
    # a header whose <|message|> comes more than 20 tokens on is not the final's
    track = _Track(sampling, None, prompt=2)
    track.restart([1, 2, *ids("<|channel|>final"), *ids(" x" * 21), *ids(MESSAGE + "1")])
    assert track.matcher is None


def test_a_marker_is_found_where_it_ends() -> None:
    think = Marker((9,))
    assert (think.end([1, 9, 2]), think.end([1, 2]), think.last, think.span) == (2, None, 9, 1)
    final = Marker((5, 6), (7,), gap=2)
    assert final.end([5, 6, 7, 1]) == 3
    assert final.end([5, 6, 0, 0, 7]) == 5  # within the gap
    assert final.end([5, 6, 0, 0, 0, 7]) is None  # beyond it
    assert final.end([5, 0, 6, 7]) is None and final.end([5, 6]) is None
    assert final.end([5, 6, 0, 0, 0, 5, 6, 7]) == 8  # a later head
    assert (final.last, final.span) == (7, 5)


def test_gpt_oss_options(tiny_lm: Path) -> None:
    r = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                             options={**TINY_LM_OPTIONS, "tool_call_parser": "openai"})  # fmt: skip
    assert r.info()["reasoning_parser"] is None
    # a harmony answer's content without the reasoning parser: still the final message's
    assert (
        r._harmony
        and OutputSplit(None, None, r._harmony).content(f"{A}x<|end|>{NEXT}{FINAL}y") == "y"
    )
    assert json.loads(json.dumps(r.info()))  # plain data


def test_gpt_oss_writes_the_calls_tool_choice_asks_for_as_harmony_calls(
    gptoss: TextGenerationRunner,
) -> None:
    # vLLM's structural tags' aim: analysis messages free, then a harmony call whose
    # arguments follow the function's schema (harmony.calls_grammar), not a JSON array
    from test_generation_reasoning import compiled
    from test_generation_runner import run
    from test_generation_tools import chat

    tok = gptoss.tokenizer
    time_call = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"

    def accepts(sampling: Any, text: str) -> bool:
        m = sampling.constraint.matcher()
        return bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))
                    and m.is_accepting())  # fmt: skip

    (prep,) = gptoss.prepare_many([chat("r", tool_choice="required")])
    spec = prep.payload  # type: ignore[union-attr]
    assert spec.reasoning and spec.sampling.constraint_after is None  # split, from the first
    required = compiled(prep)
    thought = f"{A}Which <tool>? Time.<|end|>{NEXT}"
    assert accepts(required, thought + time_call + '{"zone":"cet"}')
    assert accepts(required, time_call.replace("get_time", "get_weather") + '{"unit":"c","days":2}')
    assert not accepts(required, time_call + '{"zone":"mars"}')  # its schema
    assert not accepts(required, time_call + '{ "zone":"cet"}')  # compact
    assert not accepts(required, thought + f"{FINAL}No call.")  # a call it must make
    assert not accepts(required, time_call.replace("get_time", "get_date") + "{}")
    named = {"type": "function", "function": {"name": "get_time"}}
    (prep,) = gptoss.prepare_many([chat("n", tool_choice=named)])
    only = compiled(prep)
    assert accepts(only, time_call + '{"zone":"utc"}')
    assert not accepts(only, time_call.replace("get_time", "get_weather") + '{"unit":"c","days":2}')
    # generated: pushed past the analysis channel (its first letters' tokens), the random
    # model's call is the named function's, its arguments as the schema allows
    vocab = {i: tok.decode([i]) for i in range(len(tok))}
    not_analysis = {str(i): -100.0 for i, t in vocab.items() if t and "analysis".startswith(t)}
    outs = run(gptoss, chat("g", tool_choice=named, logit_bias=not_analysis, max_new_tokens=120))
    (out,) = outs["g"]
    assert out["text"].startswith(time_call), out
    assert out["finish_reason"] != "length" and "tool_calls" in out, out
    (call,) = out["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) in ({"zone": "utc"}, {"zone": "cet"})
    assert out["content"] == "" and out.get("reasoning_content") is None
    # streamed, required: the reasoning, then the call's chunks, adding up to the result's
    text = thought + time_call + '{"zone": "cet"}'
    chunks, out = generate(gptoss, "s", [*_tokens(text), "<|call|>"], stream=True,
                           tool_choice="required")  # fmt: skip
    assert out["reasoning_content"] == "Which <tool>? Time." and out["content"] == ""
    (call,) = out["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone":"cet"}'}
    assert _added(chunks) == {0: call}
    assert "".join(c["reasoning_content"] for c in chunks) == out["reasoning_content"]


def test_gpt_oss_strict_functions_hold_its_calls_not_its_messages(
    gptoss: TextGenerationRunner,
) -> None:
    from test_generation_reasoning import compiled
    from test_generation_strict_calls import _strict
    from test_generation_tools import chat

    tok = gptoss.tokenizer

    def accepts(sampling: Any, text: str) -> bool:
        m = sampling.constraint.matcher()
        return bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))
                    and m.is_accepting())  # fmt: skip

    (prep,) = gptoss.prepare_many([chat("a", tools=_strict("get_weather"))])
    spec = prep.payload  # type: ignore[union-attr]
    assert spec.reasoning and spec.sampling.constraint_after is None
    strict = compiled(prep)
    weather = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    browse = "<|channel|>analysis to=browser.search<|message|>"
    for text in (
        f"{A}Think.<|end|>{NEXT}{FINAL}Answer.",  # no call: free as ever
        f"{A}x<|end|>{NEXT}<|channel|>commentary<|message|>Checking.<|end|>{NEXT}"
        + weather
        + '{"unit":"c","days":1}',
        f'{browse}{{"q": 1}}<|end|>{NEXT}{FINAL}ok',  # a built-in tool: free
        weather.replace("get_weather", "get_time") + '{"any":[1]}',
    ):  # not strict
        assert accepts(strict, text), text
    for text in (
        weather + '{"unit":"k","days":1}',  # its schema
        weather + '{ "unit":"c","days":1}',  # compact
        f"{A}x<|end|>{NEXT}<|channel|>commentary to=functions.get_moon<|message|>{{}}",
        weather + '{"unit":"c","days":1}<|end|>',
    ):  # a call is the last message
        assert not accepts(strict, text), text
    # no strict function: free
    (prep,) = gptoss.prepare_many([chat("f")])
    assert prep.payload.compiling is None and prep.payload.sampling.constraint is None  # type: ignore[union-attr]
