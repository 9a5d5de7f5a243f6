"""vLLM's other reasoning parsers, each read as vLLM's code and tests read it: their tags,
whether a text begins in its reasoning without its opening tag, the tags some wrap the
answer in (hunyuan_a13b's ``<answer>``, ernie45's ``<response>``), the markers that end
the reasoning and begin the answer (kimi_k2's tool section, ling3's and glm47's ``<tool_call>``), gemma4's ``thought`` label,
and the parsers that never split (``identity``, ``minimax_m2_append_think``). Split whole
and as the text grows (:func:`check_split`), and through the runner's own delta code with
the tags as special tokens, where a constraint begins after the closing tag."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.worker.generation.reasoning import reasoning_for  # noqa: E402
from batchfleet.worker.generation.sampling import Marker  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_reasoning import check_split, generate  # noqa: E402
from test_generation_runner import run  # noqa: E402
from test_generation_tools import chat  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

DSML = "<\uff5cDSML\uff5ctool_calls>"
"""DeepSeek-V4's tool calls' start (its bars are fullwidth)."""
KIMI, KIMI_1 = "<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"
"""Kimi-K2's tool section's start (and its singular spelling)."""
IM = "<|im_start|>assistant\n"
"""ChatML's assistant turn (a prompt's end that neither opens nor closes the reasoning)."""
HUNYUAN = ("<think>\n", "\n</think>\n<answer>\n", "\n</answer>")
"""Hunyuan-A13B's think start, answer start and answer end (vLLM's tests')."""
K3_THINK = ("<|open|>think<|sep|>", "<|close|>think<|sep|>")
K3_RESPONSE = ("<|open|>response<|sep|>", "<|close|>response<|sep|>")
K3_END = "<|close|>message<|sep|>"
"""Kimi-K3's XTML think and response channels' markers, and its message's end."""
SOLAR = ("<|think:start|>", "<|think:end|>")
SOLAR_CALL = (
    "<|tool_call:start|>get_weather\n"
    "<|tool_arg:start|>city<|tool_arg:value|>Seoul<|tool_arg:end|>\n<|tool_call:end|>"
)
"""Solar-Open2's think markers and a tool call (vLLM's tests')."""
LING_CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
"""A Ling 3 (GLM-4.7) tool call."""


@pytest.mark.parametrize(
    ("parser", "prompt_end", "text", "reasoning", "answer"),
    [
        # hunyuan_a13b: <think> ... </think> then the answer in <answer> ... </answer>; a
        # text that does not begin with <think> is all answer
        ("hunyuan_a13b", "<|extra_0|>", "{0}hm, so{1}Paris.{2}", "hm, so", "\nParis.\n"),
        ("hunyuan_a13b", "<|extra_0|>", "{0}{1}Paris.{2}", "", "\nParis.\n"),  # no_think
        ("hunyuan_a13b", "<|extra_0|>", "{0}hm{1}Par", "hm", "\nPar"),  # cut answering
        ("hunyuan_a13b", "<|extra_0|>", "{0}hm{1}", "hm", "\n"),
        ("hunyuan_a13b", "<|extra_0|>", "{0}still", "still", ""),  # cut thinking
        ("hunyuan_a13b", "<|extra_0|>", "Paris.", None, "Paris."),
        ("hunyuan_a13b", "<|extra_0|>", "{0}a{1}b{2}\nafter", "a", "\nb\n"),
        # ernie45: begins in its reasoning; <response> ... </response> wraps the answer,
        # or the answer is all that follows </think>
        ("ernie45", IM, "abc\n</think>\n\n<response>\ndef\n</response>\n", "abc", "\ndef\n"),
        ("ernie45", IM, "abc\n</think>\ndef", "abc", "\ndef"),
        ("ernie45", IM, "abc", "abc", ""),
        ("ernie45", IM, "<think>abc</think>def", "abc", "def"),
        ("ernie45", IM, "a</think>\n<response>\nde", "a", "\nde"),
        ("ernie45", IM, "a</think><respond>", "a", "<respond>"),
        # step3: no opening tag: all that comes before </think> is reasoning, a <think>
        # written too
        ("step3", "<|BOT|>assistant\n<think>\n", "hm, so</think>Paris.", "hm, so", "Paris."),
        ("step3", "<|BOT|>assistant\n", "hm, so</think>Paris.", "hm, so", "Paris."),
        ("step3", "<|BOT|>assistant\n", "still", "still", ""),
        ("step3", "<|BOT|>assistant\n", "<think>hm</think>x", "<think>hm", "x"),
        ("step3", "<|BOT|>assistant\n</think>", "Paris.", None, "Paris."),  # prompt closed it
        # begin in their reasoning, a leading <think> left out (R1's)
        ("step3p5", IM, "hm\n</think>\nParis.", "hm", "\nParis."),
        ("step3p5", IM, "<think>hm</think>Paris.", "hm", "Paris."),
        ("minimax_m2", "]~b]ai\n<think>\n", "hm</think>Paris.", "hm", "Paris."),
        ("minimax_m2", "]~b]ai\n", "hm, still", "hm, still", ""),
        ("minimax_m2", "]~b]ai\n", "</think>Paris.", "", "Paris."),
        ("glm47", "<|assistant|>\n<think>", "hm</think>\nParis.", "hm", "\nParis."),
        ("glm47", "<|assistant|>\n", "<think>hm</think>Paris.", "hm", "Paris."),
        ("glm47", "<|assistant|>\n<think></think>", "Paris.", None, "Paris."),
        # glm47: a <tool_call> ends its reasoning too and begins the answer (vLLM's)
        ("glm47", "<|assistant|>\n<think>", f"plan{LING_CALL}", "plan", LING_CALL),
        (
            "glm47",
            "<|assistant|>\n",
            f"<think>a\n{LING_CALL}</think>ok",
            "a",
            f"{LING_CALL}</think>ok",
        ),
        ("glm47", "<|assistant|>\n<think></think>", f"ok{LING_CALL}", None, f"ok{LING_CALL}"),
        ("holo2", IM, "hm</think>Paris.", "hm", "Paris."),
        ("holo2", IM + "<think>\n\n</think>\n\n", "Paris.", None, "Paris."),
        ("nemotron_v3", IM, "hm</think>Paris.", "hm", "Paris."),
        ("nemotron_v3", IM + "<think></think>", "Paris.", None, "Paris."),
        # olmo3: plain-text tags, the opening one optional
        ("olmo3", IM, "The user.</think>No thoughts!", "The user.", "No thoughts!"),
        ("olmo3", IM, "<think>\nhm\n</think>\n\nok", "hm", "\n\nok"),
        ("olmo3", IM, "</think>\n\nNo thoughts", "", "\n\nNo thoughts"),
        # kimi_k2: begins in its reasoning, which its tool section ends too (the section
        # is the answer's, where its calls are read)
        ("kimi_k2", "<|im_assistant|>assistant<|im_middle|>", f"hm{KIMI}x", "hm", f"{KIMI}x"),
        ("kimi_k2", "<|im_middle|>", "<think>hm</think>ok", "hm", "ok"),
        ("kimi_k2", "<|im_middle|>", f"<think>a</think>b{KIMI}c", "a", f"b{KIMI}c"),
        ("kimi_k2", "<|im_middle|>", f"hm{KIMI_1}x", "hm", f"{KIMI_1}x"),  # singular
        ("kimi_k2", "<|im_middle|><think>", "implicit, cut", "implicit, cut", ""),
        ("kimi_k2", "<|im_middle|><think></think>", "Paris.", None, "Paris."),  # thinking off
        # deepseek_v3's way (the prompt's end, else the text's start) and more
        ("deepseek_v4", "<\uff5cAssistant\uff5c><think>", f"hm{DSML}x", "hm", f"{DSML}x"),
        ("deepseek_v4", "<\uff5cAssistant\uff5c><think>", "hm</think>ok", "hm", "ok"),
        ("deepseek_v4", "<\uff5cAssistant\uff5c></think>", "Paris.", None, "Paris."),
        ("hy_v3", "<\uff5chy_Assistant\uff5c>\n<think>", "hm</think>Paris.", "hm", "Paris."),
        ("hy_v3", "<\uff5chy_Assistant\uff5c>", "Paris.", None, "Paris."),  # no_think
        ("poolside_v1", "<assistant><think>", "hm</think>Paris.", "hm", "Paris."),
        ("poolside_v1", "<assistant>", "Paris.", None, "Paris."),
        ("poolside_v1", "<assistant>", "<think>hm</think>Paris.", "hm", "Paris."),
        ("mimo", IM, "<think>hm</think>Paris.", "hm", "Paris."),
        ("mimo", IM, "Paris.", None, "Paris."),
        # minimax_m3: <mm:think> ... </mm:think>, begun where the prompt opens it
        # (thinking_mode "enabled") or the text begins with it; a stray </mm:think> at
        # the very start of an answer is left out, one later is the answer's (vLLM's tests)
        ("minimax_m3", IM, "<mm:think>plan</mm:think>answer", "plan", "answer"),
        ("minimax_m3", IM, "plain answer", None, "plain answer"),
        ("minimax_m3", IM, "</mm:think>answer", None, "answer"),
        ("minimax_m3", IM, "</mm:think>", None, ""),
        ("minimax_m3", IM, "</mm:thin", None, "</mm:thin"),  # cut: not the tag after all
        ("minimax_m3", IM, "XXX</mm:think>YYY", None, "XXX</mm:think>YYY"),
        ("minimax_m3", IM + "<mm:think>", "plan</mm:think>answer", "plan", "answer"),
        ("minimax_m3", IM + "<mm:think>", "</mm:think>answer", "", "answer"),
        ("minimax_m3", IM + "<mm:think>", "still", "still", ""),
        ("minimax_m3", IM, "<mm:think>still thinking", "still thinking", ""),
        ("minimax_m3", IM + "<mm:think></mm:think>", "</mm:think>ok", None, "ok"),
        # solar_open2: its prompt opens <|think:start|> (closes it too, at a low effort):
        # reasoning up to <|think:end|>, or up to a tool call it writes while thinking,
        # which begins the answer (vLLM's streamed split)
        (
            "solar_open2",
            IM + SOLAR[0],
            f"I need to analyze{SOLAR[1]}The answer is 42",
            "I need to analyze",
            "The answer is 42",
        ),
        ("solar_open2", IM + SOLAR[0], "Still thinking...", "Still thinking...", ""),
        ("solar_open2", IM + SOLAR[0], f"My reasoning{SOLAR[1]}", "My reasoning", ""),
        ("solar_open2", IM + SOLAR[0] + SOLAR[1], "Hello, world!", None, "Hello, world!"),
        ("solar_open2", IM + SOLAR[0], f"{SOLAR[1]}Direct answer", "", "Direct answer"),
        (
            "solar_open2",
            IM + SOLAR[0],
            f"Step 1\nStep 2\n{SOLAR[1]}Final",
            "Step 1\nStep 2",
            "Final",
        ),
        ("solar_open2", IM + SOLAR[0], f"checking\n{SOLAR_CALL}", "checking", SOLAR_CALL),
        (
            "solar_open2",
            IM + SOLAR[0],
            f"plan\n{SOLAR_CALL}\n{SOLAR[1]}ok",
            "plan",
            f"{SOLAR_CALL}\n{SOLAR[1]}ok",
        ),
        (
            "solar_open2",
            IM,
            f"{SOLAR[0]}hm{SOLAR[1]}ok",
            f"{SOLAR[0]}hm",
            "ok",
        ),  # no opening tag of its own
        # kimi_k3: XTML channels; begins in its reasoning (thinking on); the content is
        # what its response channel wraps
        (
            "kimi_k3",
            IM,
            f"{K3_THINK[0]}hm{K3_THINK[1]}{K3_RESPONSE[0]}Paris.{K3_RESPONSE[1]}{K3_END}",
            "hm",
            "Paris.",
        ),
        (
            "kimi_k3",
            IM + K3_THINK[0],
            f"hm{K3_THINK[1]}{K3_RESPONSE[0]}Paris.{K3_RESPONSE[1]}{K3_END}",
            "hm",
            "Paris.",
        ),
        ("kimi_k3", IM, f"hm{K3_THINK[1]}{K3_RESPONSE[0]}Par", "hm", "Par"),
        ("kimi_k3", IM, f"hm{K3_THINK[1]}ok", "hm", "ok"),
        ("kimi_k3", IM, "still", "still", ""),
        (
            "kimi_k3",
            IM + K3_THINK[0] + K3_THINK[1],
            f"{K3_RESPONSE[0]}Paris.{K3_RESPONSE[1]}",
            None,
            "Paris.",
        ),
        # hy_v4: begins in its reasoning (its prompt opens <think>), a <think> it writes
        # left out; no_think's prompt closes it (vLLM's tests)
        ("hy_v4", IM, "<think>abc</think>def", "abc", "def"),
        ("hy_v4", IM, "abc</think>def", "abc", "def"),
        ("hy_v4", IM + "<think>", "cut", "cut", ""),
        ("hy_v4", IM + "<think></think>", "def", None, "def"),
        # ling3: GLM-4.7's <think>, thinking on unless the prompt closed it; a <tool_call>
        # written while thinking ends the reasoning and begins the answer (vLLM's stream;
        # its whole-text read takes a text that never closes its reasoning, or closes it
        # with nothing after, as all content: here, as streamed, reasoning)
        ("ling3", "<|role_end|><role>ASSISTANT</role>", "hm</think>\nParis.", "hm", "\nParis."),
        ("ling3", IM, "<think>hm</think>Paris.", "hm", "Paris."),
        ("ling3", IM, f"plan{LING_CALL}", "plan", LING_CALL),
        ("ling3", IM, f"<think>plan\n{LING_CALL}</think>ok", "plan", f"{LING_CALL}</think>ok"),
        ("ling3", IM, "still thinking", "still thinking", ""),
        ("ling3", IM, "all thought</think>", "all thought", ""),
        ("ling3", IM + "<think></think>", f"Paris.{LING_CALL}", None, f"Paris.{LING_CALL}"),
        # gemma4: <|channel> ... <channel|>, its reasoning's "thought" label left out
        ("gemma4", "model\n", "<|channel>thought\nhm<channel|>Paris.", "hm", "Paris."),
        ("gemma4", "model\n", "<|channel>thoughtful<channel|>x", "thoughtful", "x"),
        ("gemma4", "model\n", "<|channel>thought\ncut", "cut", ""),
        ("gemma4", "model\n", "Paris.", None, "Paris."),
        # never split: all answer, minimax_m2_append_think's with the <think> put back
        (
            "minimax_m2_append_think",
            "<think>\n",
            "hm</think>Paris.",
            None,
            "<think>hm</think>Paris.",
        ),
        ("minimax_m2_append_think", "]~b]ai\n", "", None, "<think>"),
        ("identity", "<think>", "hm</think>Paris.", None, "hm</think>Paris."),
    ],
)
def test_split(parser: str, prompt_end: str, text: str, reasoning: str | None, answer: str) -> None:
    check_split(parser, prompt_end, text.format(*HUNYUAN), reasoning, answer)


SUFFIX = ":6124c78e"
"""An HY-V4 checkpoint's structural tokens' suffix."""


@pytest.mark.parametrize(
    ("vocab", "tags"),
    [
        ([f"<tool_calls{SUFFIX}>", f"<think{SUFFIX}>", f"</think{SUFFIX}>", "a"],
         (f"<think{SUFFIX}>", f"</think{SUFFIX}>")),
        (["a", "<think>", "</think>", "<arg_key>"], ("<think>", "</think>")),
    ],
)  # fmt: skip
def test_hy_v4s_tags_end_in_the_suffix_its_vocabulary_tells(
    vocab: list[str], tags: tuple[str, str]
) -> None:
    split = reasoning_for("hy_v4", vocab)
    assert (split.open, split.close) == tags
    text = f"abc{tags[1]}def"
    assert split.split(text, split.opens(f"{IM}{tags[0]}")) == ("abc", "def")
    assert split.split(f"{tags[0]}{tags[1]}def", split.opens(IM)) == ("", "def")


def test_hy_v4_without_its_think_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match=r"hy_v4.*<think:x>"):
        reasoning_for("hy_v4", ["<arg_key:x>", "<think>", "</think>"])
    with pytest.raises(ValueError, match="hy_v4"):
        reasoning_for("hy_v4", ["a", "b"])


def test_a_runner_reads_hy_v4s_tags_off_its_tokenizer(tagged: Path, tiny_lm: Path) -> None:
    # the tagged tokenizer's <think> tokens have no suffix; the plain one has none at all
    assert runner_for(tagged, "hy_v4")._reasoning.close == "</think>"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="hy_v4"):
        runner_for(tiny_lm, "hy_v4")


HUNYUAN_PIECES = ["<think>", "\nhm,", " so\n", "</think>", "\n<answer>", "\nParis.", "\n</answer>"]
SPECIALS = ("<think>", "</think>", KIMI, "<answer>", "</answer>", "<|channel>", "<channel|>",
            "<mm:think>", "</mm:think>", *SOLAR, "<|tool_call:start|>", "<|open|>", "<|close|>",
            "<|sep|>")  # fmt: skip
"""The tags the tiny model's tokenizer makes special tokens (kept in the text, split on)."""


@pytest.fixture(scope="module")
def tagged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("tiny-tagged"), specials=SPECIALS)


def runner_for(path: Path, parser: str, **options: str) -> TextGenerationRunner:
    return TextGenerationRunner(
        path,
        device=DEVICE,
        dtype="float32",
        options={**TINY_LM_OPTIONS, "reasoning_parser": parser, **options},
    )


@pytest.mark.parametrize(
    ("parser", "pieces", "reasoning", "content"),
    [
        ("hunyuan_a13b", HUNYUAN_PIECES, "hm, so", "Paris."),
        ("step3", ["hm,", " so", "</think>", " Paris."], "hm, so", "Paris."),
        (
            "gemma4",
            ["<|channel>", "thought", "\nhm,", " so", "<channel|>", "Paris."],
            "hm, so",
            "Paris.",
        ),
        (
            "minimax_m2_append_think",
            ["hm,", " so", "</think>", " Paris."],
            None,
            "<think>hm, so</think> Paris.",
        ),
        ("identity", ["hm,", " so", "</think>", " Paris."], None, "hm, so Paris."),
        ("minimax_m3", ["<mm:think>", "hm,", " so", "</mm:think>", " Paris."], "hm, so", "Paris."),
        ("solar_open2", ["hm,", " so", SOLAR[1], " Paris."], "hm, so", "Paris."),
    ],
)
def test_the_runner_splits_keeps_and_streams_by_a_parsers_tags(
    tagged: Path, parser: str, pieces: list[str], reasoning: str | None, content: str
) -> None:
    # the tags are special tokens: kept in the text, split on, never streamed half-written,
    # and a constraint begins after the closing tag (identity's: from the first token)
    runner = runner_for(tagged, parser)
    close = runner.tokenizer.convert_tokens_to_ids(reasoning_for(parser).close)
    (prep,) = runner.prepare_many([chat("c", tools=None, structured_outputs={"regex": "[0-9]"})])
    assert prep.payload.reasoning  # type: ignore[union-attr]  # split, the constraint after
    after = prep.payload.sampling.constraint_after  # type: ignore[union-attr]
    assert after == (None if parser == "identity" else Marker((close,)))
    chunks, out = generate(runner, "g", pieces, tools=None, stream=True)
    # (identity reads no tags: a special </think> is left out as any other)
    assert out["text"] == ("".join(pieces) if parser != "identity" else content)
    assert (out.get("reasoning_content"), out["content"]) == (reasoning, content)
    for key in ("reasoning_content", "content"):
        assert "".join(c[key] for c in chunks) == out.get(key, "")
    # each piece a start of what is left of the result's: no tag was streamed half-written
    said = [(c["reasoning_content"], c["content"]) for c in chunks]
    assert not any("<" in r for r, _ in said) and "<answer" not in "".join(c for _, c in said)


def test_kimi_k2s_tool_section_ends_its_reasoning_and_its_calls_are_read(tagged: Path) -> None:
    # no </think>: the tool section begins the answer, where the call is read
    runner = runner_for(tagged, "kimi_k2", tool_call_parser="kimi_k2")
    call = (
        '<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{"zone": "cet"}'
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    chunks, out = generate(runner, "k", ["I will", " call it", KIMI, call], stream=True)
    assert out["reasoning_content"] == "I will call it" and out["content"] == ""
    assert [(c["function"]["name"], c["id"]) for c in out["tool_calls"]] == [
        ("get_time", "functions.get_time:0")
    ]
    assert "".join(c["reasoning_content"] for c in chunks) == out["reasoning_content"]
    assert [c for ch in chunks for c in ch.get("tool_calls", ())] == out["tool_calls"]


@pytest.mark.parametrize("parser", ["ling3", "glm47"])
def test_a_tool_call_ends_ling3s_and_glm47s_reasoning_and_is_read(
    tagged: Path, parser: str
) -> None:
    # thinking on (the prompt silent), no </think>: the <tool_call> begins the answer,
    # where ling3's tool parser (GLM-4.7's format) reads it
    runner = runner_for(tagged, parser, tool_call_parser="ling3")
    call = "get_time<arg_key>zone</arg_key><arg_value>cet</arg_value></tool_call>"
    chunks, out = generate(runner, "l", ["I will", " call it", "<tool_call>", call], stream=True)
    assert out["reasoning_content"] == "I will call it" and out["content"] == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]] == [
        ("get_time", '{"zone":"cet"}')
    ]
    assert "".join(c["reasoning_content"] for c in chunks) == out["reasoning_content"]


def test_kimi_k3s_channels_are_kept_in_the_text_and_split_on(tagged: Path) -> None:
    # each XTML marker is three tokens, <|open|>/<|close|>, a word and <|sep|>: the special
    # ones are kept in the text (else the markers would be lost with them), and the
    # content is what the response channel wraps, without its message's end
    runner = runner_for(tagged, "kimi_k3")
    pieces = ["<|open|>", "think", "<|sep|>", "hm,", " so", "<|close|>", "think", "<|sep|>",
              "<|open|>", "response", "<|sep|>", "Paris.", "<|close|>", "response", "<|sep|>",
              K3_END]  # fmt: skip
    chunks, out = generate(runner, "k3", pieces, tools=None, stream=True)
    assert out["text"] == "".join(pieces)
    assert (out["reasoning_content"], out["content"]) == ("hm, so", "Paris.")
    for key in ("reasoning_content", "content"):
        assert "".join(c[key] for c in chunks) == out[key]
    assert not any("<|" in c["reasoning_content"] + c["content"] for c in chunks)


@pytest.mark.parametrize("parser", ["step3", "minimax_m2_append_think", "hunyuan_a13b"])
def test_a_constraint_begins_after_the_closing_tag(tagged: Path, parser: str) -> None:
    # </think> pushed first: the regex holds from the token after it; never writing it,
    # the text is free (step3 has no opening tag: its texts begin in their reasoning)
    runner = runner_for(tagged, parser)
    think_end = runner.tokenizer.convert_tokens_to_ids("</think>")
    kw: dict[str, Any] = {"tools": None}
    if parser != "step3":  # the prompt opens <think> (MiniMax-M2's does; here, a prefill)
        kw |= {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>"},
            ],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
    digits = {"regex": "[0-9]{3}"}
    never = {str(think_end): -100.0}
    ended = chat(
        "ended",
        structured_outputs=digits,
        max_new_tokens=20,
        logit_bias={str(think_end): 100.0},
        **kw,
    )
    free = chat("free", structured_outputs=digits, max_new_tokens=8, logit_bias=never, **kw)
    plain = chat("plain", max_new_tokens=8, logit_bias=never, **kw)
    outs = run(runner, ended, free, plain)
    (out,) = outs["ended"]
    assert re.fullmatch("</think>[0-9]{3}", out["text"]) and out["finish_reason"] == "stop"
    assert outs["free"][0]["text"] == outs["plain"][0]["text"]  # unconstrained
