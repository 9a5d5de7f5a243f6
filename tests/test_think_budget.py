"""vLLM's ``thinking_token_budget``: the per-sequence state machine (table-driven), the
sampler forcing the end tag (a resume replays it), and both engines with a tiny random
model whose tokenizer has ``<think>`` and ``</think>`` tokens: N reasoning tokens, then
``</think>``, then the answer; 0 closes it at once; a model ending it itself is left
alone; a model without markers refuses the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.inputs import TokenPrompt  # noqa: E402
from batchfleet.schemas.messages import Request  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling, SeededSampler  # noqa: E402
from batchfleet.worker.generation.think_budget import (  # noqa: E402
    BudgetState,
    Phase,
    ThinkBudget,
    markers,
    opens,
)
from batchfleet.worker.runner import PrepareError  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_runner import run  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

S, E = 7, 9  # <think>, </think>
X = 5  # any other token

# --- the state machine ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "out", "phase", "forced"),
    [
        # the prompt opened the reasoning: counted from the first token
        (ThinkBudget(3, (E,), (S,), True), [], Phase.THINKING, None),
        (ThinkBudget(3, (E,), (S,), True), [X, X], Phase.THINKING, None),
        (ThinkBudget(3, (E,), (S,), True), [X, X, X], Phase.FORCING, E),
        (ThinkBudget(3, (E,), (S,), True), [X, X, X, E], Phase.DONE, None),
        (ThinkBudget(3, (E,), (S,), True), [X, E], Phase.DONE, None),  # ended itself
        (ThinkBudget(3, (E,), (S,), True), [X, E, X, X, X], Phase.DONE, None),
        (ThinkBudget(0, (E,), (S,), True), [], Phase.FORCING, E),  # none at all
        # a leading opening tag (the model opening what its prompt opened): not counted
        (ThinkBudget(1, (E,), (S,), True), [S], Phase.THINKING, None),
        (ThinkBudget(1, (E,), (S,), True), [S, X], Phase.FORCING, E),
        (ThinkBudget(1, (E,), (S,), True), [X, S], Phase.FORCING, E),  # not leading
        # the text's start tells: an opening tag first, else all answer
        (ThinkBudget(2, (E,), (S,), None), [], Phase.OPENING, None),
        (ThinkBudget(2, (E,), (S,), None), [S, X], Phase.THINKING, None),
        (ThinkBudget(2, (E,), (S,), None), [S, X, X], Phase.FORCING, E),
        (ThinkBudget(0, (E,), (S,), None), [S], Phase.FORCING, E),
        (ThinkBudget(0, (E,), (S,), None), [X, S], Phase.DONE, None),
        (ThinkBudget(0, (E,), (), None), [], Phase.DONE, None),  # no opening tag at all
        (ThinkBudget(0, (E,), (S, X), None), [S, X], Phase.FORCING, E),  # two tokens
        (ThinkBudget(0, (E,), (S, X), None), [S, S], Phase.DONE, None),
        # the prompt closed it: nothing is forced
        (ThinkBudget(0, (E,), (S,), False), [], Phase.DONE, None),
        (ThinkBudget(0, (E,), (S,), False), [S, X], Phase.DONE, None),
        # an end tag of several tokens: forced one a step, from where the text began it
        (ThinkBudget(2, (E, 8), (S,), True), [X, X], Phase.FORCING, E),
        (ThinkBudget(2, (E, 8), (S,), True), [X, X, E], Phase.FORCING, 8),
        (ThinkBudget(2, (E, 8), (S,), True), [X, X, E, 8], Phase.DONE, None),
        (ThinkBudget(2, (E, 8), (S,), True), [X, E], Phase.FORCING, 8),  # begun: its rest
        (ThinkBudget(4, (E, 8), (S,), True), [X, E, 8], Phase.DONE, None),
        # another marker that ends the reasoning (a tool-call section's)
        (ThinkBudget(3, (E,), (S,), True, ((4, 3),)), [X, 4, 3], Phase.DONE, None),
        (ThinkBudget(3, (E,), (S,), True, ((4, 3),)), [X, 4, 4], Phase.FORCING, E),
    ],
)
def test_the_state_machine(rule: ThinkBudget, out: list[int], phase: Phase,
                           forced: int | None) -> None:  # fmt: skip
    state = BudgetState.replay(rule, out)
    assert (state.phase, state.forced()) == (phase, forced)
    # fed one token at a time, it stands where the replay of the whole output stands
    step = BudgetState.begin(rule)
    for token in out:
        step.took(token)
    assert step == state


def test_a_budget_needs_an_end_tag_and_no_negative_count() -> None:
    with pytest.raises(ValueError, match="end tag"):
        ThinkBudget(1, ())
    with pytest.raises(ValueError, match="< 0"):
        ThinkBudget(-1, (E,))


@pytest.mark.parametrize(
    ("end", "want"),
    [("<|im_start|>assistant\n<think>\n", True), ("<think>\n\n</think>\n\n", False),
     ("assistant\n", None)],
)  # fmt: skip
def test_a_prompt_end_tells_by_the_markers(end: str, want: bool | None) -> None:
    assert opens(end, "<think>", "</think>") is want


def test_the_markers_come_from_the_option_else_the_parser() -> None:
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    got = markers({"reasoning_start_str": "<a>", "reasoning_end_str": "</a>"}, ("<t>", "</t>"),
                  ("<c>",), encode)  # fmt: skip
    assert got is not None and (got.start_str, got.end_str) == ("<a>", "</a>")
    assert got.end == tuple(map(ord, "</a>")) and got.enders == (tuple(map(ord, "<c>")),)
    parsed = markers(None, ("<t>", "</t>"), (), encode)
    assert parsed is not None and parsed.start == tuple(map(ord, "<t>"))
    assert markers(None, None, (), encode) is None  # no parser, no option
    assert markers(None, ("", ""), (), encode) is None  # a parser without tags
    for bad in ({"reasoning_end_str": ""}, {"reasoning_end": "x"}, "</think>"):
        with pytest.raises(ValueError, match="reasoning_config"):
            markers(bad, None, (), encode)


# --- the sampler ------------------------------------------------------------------------


def test_the_sampler_forces_the_end_and_a_resume_counts_again() -> None:
    rule = ThinkBudget(2, (E, 8), (S,), True)
    logits = torch.zeros(16)
    logits[X] = 5.0  # the model's own pick
    sampler = SeededSampler()
    sampler.add("s", Sampling(think=rule, logprobs=0), [1, 2])
    picks = [sampler.draw("s", logits) for _ in range(6)]
    assert picks == [X, X, E, 8, X, X]
    # forced tokens keep the model's own log-probability (vLLM's raw logprobs)
    lps = sampler.logprobs("s")
    assert [lp[0] for lp in lps] == picks and lps[2][1] == pytest.approx(
        float(torch.log_softmax(logits, -1)[E])
    )
    # preempted after three tokens, it comes back with its prompt and output: the rest of
    # the end tag is forced, and drafts for it would be refused
    sampler.add("s", Sampling(think=rule, logprobs=0), [1, 2, X, X, E])
    assert sampler.forcing("s")
    assert sampler.draw("s", logits) == 8 and not sampler.forcing("s")
    # a draft the forced token disagrees with is refused, the forced token emitted
    sampler.add("v", Sampling(think=ThinkBudget(1, (E,), (S,), True)), [1])
    rows = logits.expand(3, -1)
    assert sampler.verify("v", rows, [X, X]) == [X, E]


# --- the engines ------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reasoner_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("tiny-think"), specials=("<think>", "</think>"))


@pytest.fixture(scope="module", params=["padded", "paged"])
def reasoner(reasoner_dir: Path, request: pytest.FixtureRequest) -> TextGenerationRunner:
    """DeepSeek-R1's parser: a chat's text begins in its reasoning."""
    options = {**TINY_LM_OPTIONS, "reasoning_parser": "deepseek_r1", "engine": request.param}
    return TextGenerationRunner(reasoner_dir, device=DEVICE, dtype="float32", options=options)


def chat(rid: str, **kw: Any) -> Request:
    return Request(id=rid, model="lm", messages=CHAT, return_token_ids=True,
                   max_new_tokens=kw.pop("max_new_tokens", 10), **kw)  # fmt: skip


def test_n_reasoning_tokens_then_the_end_then_the_answer(reasoner: TextGenerationRunner) -> None:
    end = reasoner.tokenizer.convert_tokens_to_ids("</think>")
    outs = run(reasoner, chat("free"), chat("b3", thinking_token_budget=3, logprobs=1),
               chat("b0", thinking_token_budget=0), chat("b5", thinking_token_budget=5))  # fmt: skip
    free = outs["free"][0]["token_ids"]
    assert end not in free  # a random model never ends its reasoning itself
    prompt = outs["free"][0]["prompt_token_ids"]
    for key, n in (("b3", 3), ("b0", 0), ("b5", 5)):
        (out,) = outs[key]
        ids = out["token_ids"]
        assert ids[:n] == free[:n] and ids[n] == end and end not in ids[:n], key
        assert len(ids) == 10 and out["finish_reason"] == "length"
        thought = reasoner.tokenizer.decode(ids[:n], skip_special_tokens=True).strip()
        assert out["reasoning_content"] == thought and out["content"] is not None
        # then the model's own answer: what it writes after the same tokens
        go_on = Request(id="go", model="lm", max_new_tokens=9 - n, return_token_ids=True,
                        inputs=[TokenPrompt(prompt_token_ids=prompt + ids[: n + 1])])  # fmt: skip
        assert run(reasoner, go_on)["go"][0]["token_ids"] == ids[n + 1 :], key
    # the forced token's log-probability is the model's own, as every other token's
    ids, lps = outs["b3"][0]["token_ids"], outs["b3"][0]["logprobs"]
    assert [lp["token"] for lp in lps] == ids
    scored = Request(id="s", model="lm", max_new_tokens=1, prompt_logprobs=0,
                     inputs=[TokenPrompt(prompt_token_ids=prompt + ids[:4])])  # fmt: skip
    model_own = run(reasoner, scored)["s"][0]["prompt_logprobs"][-1]
    assert model_own["token"] == end
    assert lps[3]["logprob"] == pytest.approx(model_own["logprob"], abs=1e-4)
    assert lps[3]["rank"] == model_own["rank"] > 1  # not what the model would have picked


def test_a_reasoning_ended_by_the_model_is_left_alone() -> None:
    # the model writes </think> itself before its budget is spent: nothing is forced after
    ends, goes_on = torch.zeros(16), torch.zeros(16)
    ends[E], goes_on[X] = 5.0, 5.0
    sampler = SeededSampler()
    sampler.add("s", Sampling(think=ThinkBudget(2, (E,), (S,), True)), [1])
    picks = [sampler.draw("s", logits) for logits in (goes_on, ends, goes_on, goes_on, goes_on)]
    assert picks == [X, E, X, X, X] and not sampler.forcing("s")


def test_a_constraint_begins_after_the_forced_end(reasoner: TextGenerationRunner) -> None:
    outs = run(reasoner, chat("c", thinking_token_budget=2, max_new_tokens=20,
                              structured_outputs={"regex": "[0-9]{3}"}))  # fmt: skip
    (out,) = outs["c"]
    assert out["finish_reason"] == "stop" and out["content"] is not None
    assert len(out["content"]) == 3 and out["content"].isdigit()


def test_a_model_without_markers_refuses_a_budget(tiny_lm: Path) -> None:
    plain = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                 options=TINY_LM_OPTIONS)  # fmt: skip
    (got,) = plain.prepare_many([chat("x", thinking_token_budget=4)])
    assert isinstance(got, PrepareError) and got.code == "invalid_request"
    assert "thinking_token_budget" in str(got)


def test_reasoning_config_gives_the_markers_of_a_completion(tiny_lm: Path) -> None:
    # no reasoning parser; the option's end tag takes several tokens here, forced one a
    # step once the prompt's open reasoning has had its budget
    options = {**TINY_LM_OPTIONS, "reasoning_config": {"reasoning_start_str": "<think>",
                                                       "reasoning_end_str": "</think>"}}  # fmt: skip
    lm = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32", options=options)
    end = lm.tokenizer.encode("</think>", add_special_tokens=False)
    assert len(end) > 1
    prompts = ["Question: why?\n<think>\n", "Question: why?"]
    outs = run(lm, Request(id="p", model="lm", inputs=prompts, max_new_tokens=12,
                           thinking_token_budget=2, return_token_ids=True))  # fmt: skip
    opened, plain = (o["token_ids"] for o in outs["p"])
    assert opened[2 : 2 + len(end)] == end
    free = run(lm, Request(id="f", model="lm", inputs=prompts[1:], max_new_tokens=12,
                           return_token_ids=True))["f"][0]["token_ids"]  # fmt: skip
    assert plain == free  # the prompt did not open it: nothing forced


def test_speculation_skips_a_forced_row_and_gives_the_same_tokens(reasoner_dir: Path) -> None:
    options = {**TINY_LM_OPTIONS, "reasoning_parser": "deepseek_r1", "engine": "padded"}
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    reqs = [chat(f"r{n}", thinking_token_budget=n, max_new_tokens=16) for n in (0, 2, 5)]
    plain = run(TextGenerationRunner(reasoner_dir, device=DEVICE, dtype="float32",
                                     options=options), *reqs)  # fmt: skip
    lm = TextGenerationRunner(reasoner_dir, device=DEVICE, dtype="float32",
                              options={**options, "speculative": spec})  # fmt: skip
    sampler = lm.engine.sampler
    verify = sampler.verify

    def checked(sequence: str, *args: Any) -> list[int]:
        assert not sampler.forcing(sequence)  # no drafts for a row whose token is forced
        return verify(sequence, *args)

    sampler.verify = checked
    fast = run(lm, *reqs)
    assert lm.engine.drafted[0] > 0  # drafts were proposed (for the rows not forced)
    assert {k: o[0]["token_ids"] for k, o in fast.items()} == {
        k: o[0]["token_ids"] for k, o in plain.items()
    }


def test_the_request_field() -> None:
    assert chat("x", thinking_token_budget=0).thinking_token_budget == 0
    with pytest.raises(ValueError, match="greater than or equal"):
        chat("x", thinking_token_budget=-1)
    with pytest.raises(ValueError, match="too_large"):
        chat("x", thinking_token_budget=10**9)
    with pytest.raises(ValueError, match="thinking_token_budget"):
        chat("x", thinking_token_budget=8, use_beam_search=True)
