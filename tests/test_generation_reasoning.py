"""Reasoning models (the ``reasoning_parser`` option, vLLM's): a chat's text is split into
``reasoning_content`` and its answer (``content``); tool calls are read in the answer
only, and streamed once the reasoning is over. The split is read off texts given to the
runner's own admission and delta code (a random model writes no reasoning); a
constraint begins after the reasoning."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.worker.generation.reasoning import REASONING_PARSERS, reasoning_for  # noqa: E402
from batchfleet.worker.generation.sampling import Marker, _Track  # noqa: E402
from batchfleet.worker.generation.split import OutputSplit  # noqa: E402
from batchfleet.worker.runner import Final, Partial  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_runner import run  # noqa: E402
from test_generation_tools import chat  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

GRANITE = ("Here is my thought process:", "Here is my response:")


@pytest.mark.parametrize(
    ("parser", "prompt_end", "text", "reasoning", "answer"),
    [
        ("deepseek_r1", "Assistant:", "<think>\nhm</think>\n\nParis.", "hm", "\n\nParis."),
        ("deepseek_r1", "<think>\n", "hm, so</think>Paris.", "hm, so", "Paris."),  # opened
        ("deepseek_r1", "", "hm, so</think>Paris.", "hm, so", "Paris."),  # R1 always thinks
        ("deepseek_r1", "x", "<think>still thinking", "still thinking", ""),  # cut
        ("qwen3", "assistant\n", "<think>hm</think>Paris.", "hm", "Paris."),
        ("qwen3", "assistant\n<think>\n", "hm</think>Paris.", "hm", "Paris."),  # -2507
        ("qwen3", "assistant\n", "Paris.", None, "Paris."),  # thinking off, its own way
        ("qwen3", "<think>\n\n</think>\n\n", "Paris.", None, "Paris."),  # enable_thinking
        ("qwen3", "<think>\n\n</think>\n\n", "<think>x</think>y", None, "<think>x</think>y"),
        ("qwen3", "assistant\n", "<think>cut", "cut", ""),  # cut while thinking
        ("qwen3", "<think>", "cut", "cut", ""),
        ("qwen3", "assistant\n", "Paris.</think>", None, "Paris.</think>"),  # not thinking
        ("qwen3", "assistant\n", "  <thin", None, "  <thin"),  # not <think> after all
        ("glm45", "<|assistant|>", "<think>hm</think>Paris.", "hm", "Paris."),
        ("glm45", "<|assistant|><think></think>", "Paris.", None, "Paris."),  # thinking off
        ("deepseek_v3", "Assistant:<think>", "hm</think>Paris.", "hm", "Paris."),  # V3.1 on
        ("deepseek_v3", "Assistant:</think>", "Paris.", None, "Paris."),  # V3.1 off
        ("mistral", "[/INST]", "[THINK]hm, so[/THINK]Paris.", "hm, so", "Paris."),
        ("mistral", "[/INST]", "Paris, [THINK] no.", None, "Paris, [THINK] no."),
        ("seed_oss", "assistant\n", "<seed:think>hm</seed:think>Paris.", "hm", "Paris."),
        ("seed_oss", "assistant\n", "<seed:think>cut", "cut", ""),
        (
            "granite",
            "<|end_of_role|>",
            f"{GRANITE[0]}\nhm, so\n{GRANITE[1]}\nParis.",
            "hm, so",
            "\nParis.",
        ),  # plain-text tags
        ("granite", "<|end_of_role|>", "Paris.", None, "Paris."),  # thinking off
        ("granite", "<|end_of_role|>", "Here is my", None, "Here is my"),  # not the tag
        # "Here's", as quantized Granites write it (vLLM reads both), either tag
        (
            "granite",
            "<|end_of_role|>",
            "Here's my thought process: hm Here is my response: ok",
            "hm",
            " ok",
        ),
        (
            "granite",
            "<|end_of_role|>",
            "Here is my thought process: hm Here's my response: ok",
            "hm",
            " ok",
        ),
        (
            "granite",
            "<|end_of_role|>",
            "Here's my thought process: cut Here's my",
            "cut Here's my",
            "",
        ),
        ("granite", "<|end_of_role|>", "Here's my take: Paris.", None, "Here's my take: Paris."),
    ],
)
def test_split(parser: str, prompt_end: str, text: str, reasoning: str | None,
               answer: str) -> None:  # fmt: skip
    check_split(parser, prompt_end, text, reasoning, answer)


def check_split(parser: str, prompt_end: str, text: str, reasoning: str | None,
                answer: str) -> None:  # fmt: skip
    """A text after a prompt ending ``prompt_end`` splits so, whole and as it grows."""
    split = reasoning_for(parser)
    thinking = split.opens(prompt_end)
    assert split.split(text, thinking) == (reasoning, answer)
    # while the text grows, where the answer begins is unknown until </think> (or, where
    # the text's start tells, until it does), then fixed; the reasoning so far is always
    # a start of the whole's, all of it once the answer begins, and so is the answer
    starts = [split.answer_start(text[:n], False, thinking) for n in range(len(text) + 1)]
    known = next((n for n, s in enumerate(starts) if s is not None), None)
    assert known is None or set(starts[known:]) == {starts[known]}
    ends = [(text.find(c), len(c), len(c)) for c in split.closings if c in text]
    ends += [(text.find(e), len(e), 0) for e in split.enders if e in text]  # in the answer
    end, length, skip = min(ends, default=(-1, 0, 0))
    if reasoning is not None and end >= 0:
        assert known == end + length and starts[known] == end + skip
    if reasoning is None and known is not None:  # (after a stray closing tag left out)
        stray = split.stray and text.startswith(split.close)
        assert starts[known] == (len(split.close) if stray else 0)
    shown = [split.so_far(text[:n], thinking) for n in range(len(text) + 1)]
    assert all((reasoning or "").startswith(r) for r in shown)
    if known is not None:
        assert set(shown[known:]) == {reasoning or ""}
        at = starts[known]
        assert all(answer.startswith(split.answer(text[:n][at:]))
                   for n in range(known, len(text) + 1))  # fmt: skip
    # streamed a character at a time, the deltas' pieces add up to the result's
    out = OutputSplit(split, thinking, harmony=False)
    deltas = [out.delta(text[: n + 1], text[n], None) for n in range(len(text))]
    deltas.append(out.delta(text, "", text))
    assert "".join(d["reasoning_content"] for d in deltas) == (reasoning or "")
    assert "".join(d["content"] for d in deltas) == answer.strip()


@pytest.fixture(scope="module")
def reasoner(tmp_path_factory: pytest.TempPathFactory) -> TextGenerationRunner:
    """A tiny model whose tokenizer makes ``<think>`` and ``</think>`` special tokens."""
    path = make_causal_lm(tmp_path_factory.mktemp("tiny-r1"), specials=("<think>", "</think>"))
    options = {**TINY_LM_OPTIONS, "reasoning_parser": "deepseek_r1", "tool_call_parser": "hermes"}
    return TextGenerationRunner(path, device=DEVICE, dtype="float32", options=options)


def generate(runner: TextGenerationRunner, key: str, pieces: list[str], **kw: Any) -> tuple[
    list[dict[str, Any]], dict[str, Any]
]:  # fmt: skip
    """Admit a chat request as a step would, give its sequence the tokens of ``pieces``
    one piece a step, and end it: its deltas and its output."""
    (prep,) = runner.prepare_many([chat(key, **kw)])
    runner._admit(key, prep, 1)
    r = runner._reqs[key]
    (seq,) = r.seqs
    chunks: list[dict[str, Any]] = []
    for piece in pieces:
        seq.text.extend(runner.tokenizer(piece)["input_ids"])
        chunks += [ev.chunk for ev in runner._deltas(r) if isinstance(ev, Partial)]
    *tail, final = runner._finish(r)
    chunks += [ev.chunk for ev in tail if isinstance(ev, Partial)]
    assert isinstance(final, Final)
    return chunks, final.outputs[0]


def test_calls_are_read_in_the_answer_only_and_streamed_once_it_begins(
    reasoner: TextGenerationRunner,
) -> None:
    thought = '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>'
    call = '<tool_call>{"name": "get_weather", "arguments": {"unit": "c", "days": 1}}</tool_call>'
    pieces = ["<think>I could call ", thought, " but no.", "</think>", "\n\nSure. ", call, " ok"]
    chunks, out = generate(reasoner, "r", pieces, stream=True)
    text = "".join(pieces)
    assert out["text"] == text == "".join(c["text"] for c in chunks)  # the tags kept
    assert out["reasoning_content"] == f"I could call {thought} but no."
    (made,) = out["tool_calls"]
    assert made["function"]["name"] == "get_weather"  # not the one it only thought about
    assert out["content"] == "Sure.  ok"
    streamed = [(k, c) for k, ch in enumerate(chunks) for c in ch.get("tool_calls", ())]
    assert [c for _, c in streamed] == [made]
    assert streamed[0][0] == 5  # with the piece that closed it, before the text ended
    # the deltas split the text as the result does: the reasoning (whole once </think>
    # came), then the answer without the call's markup
    assert "".join(c["reasoning_content"] for c in chunks) == out["reasoning_content"]
    assert "".join(c["content"] for c in chunks) == out["content"]
    said = [(c["reasoning_content"], c["content"]) for c in chunks]
    assert said == [("I could call", ""), (" " + thought, ""), (" but no.", ""), ("", ""),
                    ("", "Sure."), ("", ""), ("", ""),
                    ("", "  ok")]  # after the last call: at the end  # fmt: skip


@pytest.mark.parametrize("step", [1, 3])
def test_streamed_reasoning_and_content_add_up_to_the_results(
    reasoner: TextGenerationRunner, step: int
) -> None:
    # fed a few characters at a time: tags, whitespace and a call's markup held back, and
    # every piece is a start of what is left of the result's
    text = (
        "  <think>\nA <b>bold</b> thought;\n</think>\n\nIt is <i>so</i>. "
        '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>\n'
    )
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    chunks, out = generate(reasoner, "g", pieces, stream=True)
    assert out["text"] == text
    assert (out["reasoning_content"], out["content"]) == (
        "A <b>bold</b> thought;",
        "It is <i>so</i>.",
    )
    assert [c["function"]["name"] for c in out["tool_calls"]] == ["get_time"]
    for key in ("reasoning_content", "content"):
        assert "".join(c[key] for c in chunks) == out[key]
    assert not any("think>" in c["reasoning_content"] + c["content"] for c in chunks)
    assert not any("tool_call" in c["content"] for c in chunks)
    # all of the answer's content is out before the call's markup ends
    ended = next(k for k, c in enumerate(chunks) if "</tool_call>" in "".join(
        x["text"] for x in chunks[: k + 1]))  # fmt: skip
    assert "".join(c["content"] for c in chunks[: ended + 1]) == out["content"]


def test_a_prompt_that_closes_the_reasoning_is_all_answer_and_constrained_from_the_start(
    reasoner: TextGenerationRunner,
) -> None:
    # the assistant's turn begun with an empty reasoning (Qwen3's enable_thinking false):
    # the text is all answer, and a constraint holds from its first token
    closed = [{"role": "user", "content": "hi"},
              {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]  # fmt: skip
    req = chat("closed", messages=closed, continue_final_message=True,
               add_generation_prompt=False, tools=None,
               structured_outputs={"regex": "[0-9]{3}"}, max_new_tokens=10)  # fmt: skip
    (prep,) = reasoner.prepare_many([req])
    spec = prep.payload  # type: ignore[union-attr]
    assert spec.reasoning and spec.thinking is False and spec.sampling.constraint_after is None
    (out,) = run(reasoner, req)["closed"]
    assert re.fullmatch("[0-9]{3}", out["text"]) and out["finish_reason"] == "stop"
    assert out["content"] == out["text"] and "reasoning_content" not in out


def test_what_is_split_and_what_is_not(reasoner: TextGenerationRunner) -> None:
    # no tools: the answer and the reasoning; cut while thinking: all reasoning
    _, out = generate(reasoner, "plain", ["<think>x</think>", "The answer."], tools=None)
    assert (out["reasoning_content"], out["content"]) == ("x", "The answer.")
    assert "tool_calls" not in out
    _, cut = generate(reasoner, "cut", ["<think>still", " going"], tools=None)
    assert (cut["reasoning_content"], cut["content"]) == ("still going", "")
    # a completion of a prompt is not split; a constrained chat is (its constraint begins
    # after the reasoning, below)
    (required,) = reasoner.prepare_many([chat("req", tool_choice="required")])
    (prompt,) = reasoner.prepare_many([chat("p", messages=None, inputs=["a b"], tools=None)])
    assert required.payload.reasoning and not prompt.payload.reasoning  # type: ignore[union-attr]
    assert reasoner.info()["reasoning_parser"] == "deepseek_r1"


def test_the_parsers() -> None:
    assert set(REASONING_PARSERS) == {
        "deepseek_r1", "qwen3", "glm45", "deepseek_v3", "mistral", "seed_oss", "openai_gptoss",
        "granite", "deepseek_v4", "ernie45", "gemma4", "glm47", "holo2", "hunyuan_a13b",
        "hy_v3", "hy_v4", "identity", "kimi_k2", "kimi_k3", "mimo", "minimax_m2",
        "minimax_m2_append_think", "minimax_m3", "nemotron_v3", "olmo3", "poolside_v1",
        "solar_open2", "step3", "step3p5", "ling3", "cohere_command3", "cohere_command4",
        "inkling", "muse_glimmer",
    }  # fmt: skip


def test_an_unknown_reasoning_parser_is_refused(tiny_lm: Path) -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                             options={**TINY_LM_OPTIONS, "reasoning_parser": "nope"})  # fmt: skip


def test_a_constraint_begins_after_the_reasoning(reasoner: TextGenerationRunner) -> None:
    think_end = reasoner.tokenizer.convert_tokens_to_ids("</think>")
    digits = {"regex": "[0-9]{3}"}
    # </think> pushed first: the regex holds from the token after it, then the text ends
    ended = chat("ended", tools=None, structured_outputs=digits, max_new_tokens=20,
                 logit_bias={str(think_end): 100.0})  # fmt: skip
    # never ending its reasoning: free text throughout, all of it reasoning
    free = chat("free", tools=None, structured_outputs=digits, max_new_tokens=8)
    plain = chat("plain", tools=None, max_new_tokens=8)
    outs = run(reasoner, ended, free, plain)
    (out,) = outs["ended"]
    assert re.fullmatch("</think>[0-9]{3}", out["text"]) and out["finish_reason"] == "stop"
    assert (out["reasoning_content"], out["content"]) == ("", out["text"][len("</think>") :])
    (thinking,) = outs["free"]
    assert thinking["text"] == outs["plain"][0]["text"]  # unconstrained
    assert thinking["reasoning_content"] == thinking["text"].strip() and thinking["content"] == ""


def compiled(prep: Any) -> Any:
    """A prepared request's sampling with its constraint, compiled (on its thread or not)."""
    sampling = prep.payload.sampling
    if sampling.constraint is None:
        sampling = replace(sampling, constraint=prep.payload.compiling.result())
    return sampling


def test_a_resumed_sequence_takes_up_its_constraint_where_it_was(
    reasoner: TextGenerationRunner,
) -> None:
    # a preempted sequence comes back with its output as prompt: its matcher starts after
    # its </think> and goes through what followed; without one, it has none yet
    think_end = reasoner.tokenizer.convert_tokens_to_ids("</think>")
    (prep,) = reasoner.prepare_many(
        [chat("c", tools=None, structured_outputs={"regex": "[0-9]{3}"})]
    )
    sampling = compiled(prep)
    assert sampling.constraint is not None and sampling.constraint_after == Marker((think_end,))
    digits = reasoner.tokenizer("123", add_special_tokens=False)["input_ids"]
    word = reasoner.tokenizer(" the", add_special_tokens=False)["input_ids"]
    track = _Track(sampling, None, prompt=2)
    track.restart([1, 2, *word, think_end, *digits])
    assert track.matcher is not None and track.matcher.is_accepting()
    track.restart([1, 2, *word, *digits])
    assert track.matcher is None
    track.restart([1, 2, *word, think_end, *digits[:1]])
    assert track.matcher is not None and not track.matcher.is_accepting()


def test_a_parser_with_other_tags_splits_keeps_and_constrains_by_them(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # Magistral's [THINK] ... [/THINK], special tokens of its tokenizer: kept in the text,
    # split on, streamed apart, and the constraint begins after [/THINK]
    path = make_causal_lm(
        tmp_path_factory.mktemp("tiny-magistral"), specials=("[THINK]", "[/THINK]")
    )
    magistral = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                     options={**TINY_LM_OPTIONS, "reasoning_parser": "mistral"})  # fmt: skip
    close = magistral.tokenizer.convert_tokens_to_ids("[/THINK]")
    (prep,) = magistral.prepare_many([chat("c", tools=None, structured_outputs={"regex": "[0-9]"})])
    assert prep.payload.sampling.constraint_after == Marker((close,))  # type: ignore[union-attr]
    chunks, out = generate(magistral, "m", ["[THINK]", "Hm, ", "so.", "[/THINK]", " Paris."],
                           tools=None, stream=True)  # fmt: skip
    assert out["text"] == "[THINK]Hm, so.[/THINK] Paris."
    assert (out["reasoning_content"], out["content"]) == ("Hm, so.", "Paris.")
    assert [(c["reasoning_content"], c["content"]) for c in chunks] == [
        ("", ""), ("Hm,", ""), (" so.", ""), ("", ""), ("", "Paris.")]  # fmt: skip


def test_a_model_left_to_choose_whether_to_think_is_constrained_either_way(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # qwen3, a prompt that neither opens nor closes <think>: the first token may open the
    # reasoning (then the constraint begins after </think>), or it is the constraint's
    path = make_causal_lm(tmp_path_factory.mktemp("tiny-qwen3"), specials=("<think>", "</think>"))
    qwen = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, "reasoning_parser": "qwen3"})  # fmt: skip
    open_, close = (qwen.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    digits = {"regex": "[0-9]{3}"}
    direct = chat("direct", tools=None, structured_outputs=digits, max_new_tokens=10)
    (prep,) = qwen.prepare_many([direct])
    sampling = prep.payload.sampling  # type: ignore[union-attr]
    assert prep.payload.thinking is None  # type: ignore[union-attr]
    assert (sampling.constraint_after, sampling.constraint_unless) == (Marker((close,)), open_)
    # pushed to think, once (a second <think> is a bad word), then to close it
    thinks = chat("thinks", tools=None, structured_outputs=digits, max_new_tokens=10,
                  logit_bias={str(open_): 100.0, str(close): 50.0},
                  bad_words=["<think><think>"])  # fmt: skip
    outs = run(qwen, direct, thinks)
    (out,) = outs["direct"]  # did not think: constrained from its first token
    assert re.fullmatch("[0-9]{3}", out["text"]) and out["finish_reason"] == "stop"
    assert out["content"] == out["text"] and "reasoning_content" not in out
    (out,) = outs["thinks"]
    assert re.fullmatch("<think></think>[0-9]{3}", out["text"]) and out["finish_reason"] == "stop"
    assert out["reasoning_content"] == "" and re.fullmatch("[0-9]{3}", out["content"])
    # a resumed track: after a <think>, from its </think>; else through its output
    one = qwen.tokenizer("1", add_special_tokens=False)["input_ids"]
    sampling = compiled(prep)
    track = _Track(sampling, None, prompt=2)
    track.restart([1, 2])
    assert track.opening and track.matcher is not None
    track.restart([1, 2, open_, 7, close, *one])
    assert not track.opening and track.matcher is not None and not track.matcher.is_accepting()
    track.restart([1, 2, open_, 7])
    assert track.matcher is None
    track.restart([1, 2, *one])
    assert not track.opening and track.matcher is not None
