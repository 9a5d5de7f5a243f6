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
    prompt_open,
)
from batchfleet.worker.runner import PrepareError  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_runner import Driver, prepare, run  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

S, E = 7, 9  # <think>, </think>
X = 5  # any other token

# --- the state machine ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "out", "phase", "forced"),
    [
        # the text begins in its reasoning: counted from the first token
        (ThinkBudget(3, (E,), (S,), True), [], Phase.THINKING, None),
        (ThinkBudget(3, (E,), (S,), True), [X, X], Phase.THINKING, None),
        (ThinkBudget(3, (E,), (S,), True), [X, X, X], Phase.FORCING, E),
        (ThinkBudget(3, (E,), (S,), True), [X, X, X, E], Phase.DONE, None),
        (ThinkBudget(3, (E,), (S,), True), [X, E], Phase.DONE, None),  # ended itself
        (ThinkBudget(3, (E,), (S,), True), [X, E, X, X, X], Phase.DONE, None),
        (ThinkBudget(0, (E,), (S,), True), [], Phase.FORCING, E),  # none at all
        # the prompt holds reasoning tokens after its opening tag: they count (vLLM's)
        (ThinkBudget(3, (E,), (S,), True, prior=2), [], Phase.THINKING, None),
        (ThinkBudget(3, (E,), (S,), True, prior=2), [X], Phase.FORCING, E),
        (ThinkBudget(3, (E,), (S,), True, prior=2), [X, E], Phase.DONE, None),
        (ThinkBudget(3, (E,), (S,), True, prior=3), [], Phase.FORCING, E),  # all spent
        (ThinkBudget(3, (E,), (S,), True, prior=7), [], Phase.FORCING, E),
        # an opening tag the model writes after the prompt opened it: counted (vLLM's)
        (ThinkBudget(3, (E,), (S,), True, prior=1), [S], Phase.THINKING, None),
        (ThinkBudget(3, (E,), (S,), True, prior=1), [S, X], Phase.FORCING, E),
        (ThinkBudget(2, (E,), (S,), True, prior=0), [S, X], Phase.FORCING, E),
        # the split's word alone (no tag in the prompt): counted from the first token, a
        # leading opening tag the model writes restarting it (where vLLM's count starts)
        (ThinkBudget(1, (E,), (S,), True), [S], Phase.THINKING, None),
        (ThinkBudget(1, (E,), (S,), True), [S, X], Phase.FORCING, E),
        (ThinkBudget(1, (E,), (S,), True), [X, S], Phase.FORCING, E),  # not leading
        # no word (None), or the prompt closed it (False): the first opening tag the model
        # writes, wherever, opens it (vLLM watches the generated tokens for one)
        (ThinkBudget(2, (E,), (S,), None), [], Phase.WATCHING, None),
        (ThinkBudget(2, (E,), (S,), None), [S, X], Phase.THINKING, None),
        (ThinkBudget(2, (E,), (S,), None), [S, X, X], Phase.FORCING, E),
        (ThinkBudget(0, (E,), (S,), None), [S], Phase.FORCING, E),
        (ThinkBudget(0, (E,), (S,), None), [X, S], Phase.FORCING, E),
        (ThinkBudget(1, (E,), (S,), None), [X, X, S, X], Phase.FORCING, E),
        (ThinkBudget(1, (E,), (S,), None), [X, E, S], Phase.THINKING, None),  # end first
        (ThinkBudget(0, (E,), (), None), [], Phase.DONE, None),  # no opening tag at all
        (ThinkBudget(0, (E,), (S, X), None), [S, X], Phase.FORCING, E),  # two tokens
        (ThinkBudget(0, (E,), (S, X), None), [S, S], Phase.WATCHING, None),
        (ThinkBudget(0, (E,), (S, X), None), [S, S, X], Phase.FORCING, E),
        (ThinkBudget(0, (E,), (S,), False), [], Phase.WATCHING, None),
        (ThinkBudget(0, (E,), (S,), False), [X, X], Phase.WATCHING, None),
        (ThinkBudget(0, (E,), (S,), False), [X, S], Phase.FORCING, E),
        (ThinkBudget(2, (E,), (S,), False), [X, S, X, E], Phase.DONE, None),  # ended itself
        (ThinkBudget(0, (E,), (S,), False), [S, E, X, S], Phase.DONE, None),  # once only
        (ThinkBudget(1, (E,), (S,), False), [S, X, E, S, X, X], Phase.DONE, None),
        (ThinkBudget(2, (E,), (S,), False), [S, E, S, X, X], Phase.DONE, None),
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
    with pytest.raises(ValueError, match="< 0"):
        ThinkBudget(1, (E,), (S,), True, prior=-1)
    with pytest.raises(ValueError, match="opened"):
        ThinkBudget(1, (E,), (S,), None, prior=1)
    with pytest.raises(ValueError, match="opened"):
        ThinkBudget(1, (E,), (S,), False, prior=0)


@pytest.mark.parametrize(
    ("prompt", "start", "end", "held"),
    [
        ([1, 2, S], (S,), (E,), 0),  # ends with its opening tag
        ([1, S, 2, 3], (S,), (E,), 2),
        ([S, 1, E, 2, S, 3, 4, 5], (S,), (E,), 3),  # the last one counts
        ([1, S, 2, E], (S,), (E,), None),  # closed
        ([1, S, 2, E, 3], (S,), (E,), None),
        ([1, 2, 3], (S,), (E,), None),  # never opened
        ([1, 2, E], (S,), (E,), None),
        ([1, S, X, 2, 3], (S, X), (E, 8), 2),  # tags of several tokens
        ([1, S, X, 2, E, 3], (S, X), (E, 8), 3),  # not its whole end tag: still open
        ([1, S, X, 2, E, 8], (S, X), (E, 8), None),
        ([1, S, 2], (), (E,), None),  # a model without an opening tag
    ],
)
def test_the_prompt_tokens_after_its_open_tag(prompt: list[int], start: tuple[int, ...],
                                              end: tuple[int, ...], held: int | None) -> None:  # fmt: skip
    assert prompt_open(prompt, start, end) == held


def test_a_prompt_left_open_begins_the_budget_whatever_the_split_says() -> None:
    marks = markers(None, ("<t>", "</t>"), (), lambda text: [S] if text == "<t>" else [E])
    assert marks is not None
    for thinking in (True, None, False):
        assert marks.budget(4, thinking, [1, S, 2, 3]) == ThinkBudget(4, (E,), (S,), True,
                                                                      prior=2)  # fmt: skip
        # closed or never opened: as the split tells, nothing held
        assert marks.budget(4, thinking, [1, S, 2, E]) == ThinkBudget(4, (E,), (S,), thinking)
        assert marks.budget(4, thinking, [1, 2]) == ThinkBudget(4, (E,), (S,), thinking)


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
    # the prompt's reasoning counts, after a resume too: 3 of 4 in the prompt, 1 generated
    held = Sampling(think=ThinkBudget(4, (E,), (S,), True, prior=3))
    sampler.add("p", held, [1, S, 2, 2, 2])
    assert sampler.draw("p", logits) == X and sampler.forcing("p")
    sampler.add("p", held, [1, S, 2, 2, 2, X])  # preempted, back with its output
    assert sampler.forcing("p") and sampler.draw("p", logits) == E
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
    kw.setdefault("messages", CHAT)
    return Request(id=rid, model="lm", return_token_ids=True,
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


def open_prompt(runner: TextGenerationRunner, held: int, close: bool = False) -> list[int]:
    """A prompt that opened its reasoning and holds ``held`` tokens of it (``close``: then
    closed it, and goes on a little)."""
    think, end = (runner.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    words = runner.tokenizer.encode(" the man was", add_special_tokens=False)
    ids = [*runner.tokenizer.encode("Question: why?\n", add_special_tokens=False), think]
    ids += (words * held)[:held]
    return [*ids, end, *words] if close else ids


def tokens(runner: TextGenerationRunner, prompt: list[int], **kw: Any) -> list[int]:
    got = run(runner, Request(id="t", model="lm", inputs=[TokenPrompt(prompt_token_ids=prompt)],
                              max_new_tokens=10, return_token_ids=True, **kw))  # fmt: skip
    ids: list[int] = got["t"][0]["token_ids"]
    return ids


def test_a_prompt_s_open_reasoning_counts_toward_the_budget(
    reasoner: TextGenerationRunner,
) -> None:
    # Given prompts that opened the reasoning and hold N tokens of it
    end = reasoner.tokenizer.convert_tokens_to_ids("</think>")
    for held, budget in ((2, 5), (1, 3), (4, 6)):
        prompt = open_prompt(reasoner, held)
        free = tokens(reasoner, prompt)
        assert end not in free
        # When the budget is B, Then the end is forced after B - N generated tokens
        ids = tokens(reasoner, prompt, thinking_token_budget=budget)
        n = budget - held
        assert ids[:n] == free[:n] and ids[n] == end and end not in ids[:n], (held, budget)
    # a prompt holding the whole budget (or more) has the end forced first
    for held in (3, 4):
        assert tokens(reasoner, open_prompt(reasoner, held), thinking_token_budget=3)[0] == end


def test_a_prompt_that_closed_its_reasoning_has_nothing_forced(
    reasoner: TextGenerationRunner,
) -> None:
    prompt = open_prompt(reasoner, 4, close=True)
    free = tokens(reasoner, prompt)
    # (the model writes no opening tag of its own here: one would open the count)
    assert reasoner.tokenizer.convert_tokens_to_ids("<think>") not in free
    assert tokens(reasoner, prompt, thinking_token_budget=0) == free


def test_an_opening_tag_the_model_writes_after_a_closed_prompt_opens_the_count(
    reasoner: TextGenerationRunner,
) -> None:
    # Given a prompt that closed its reasoning, and a model biased to write <think>
    think, end = (reasoner.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    prompt = [*open_prompt(reasoner, 4), end]
    bias = {str(think): 100.0}
    assert tokens(reasoner, prompt, logit_bias=bias) == [think] * 10
    # When its budget is 2, Then its first <think> opens the count: two more, then the end
    # (forced over the bias), and a reasoning ended does not open again
    ids = tokens(reasoner, prompt, logit_bias=bias, thinking_token_budget=2)
    assert ids == [think, think, think, end] + [think] * 6


def test_a_preempted_sequence_keeps_its_prompt_s_count(reasoner: TextGenerationRunner) -> None:
    # Given a prompt holding 2 reasoning tokens and a budget of 6 (4 left to generate)
    end = reasoner.tokenizer.convert_tokens_to_ids("</think>")
    request = Request(id="pre", model="lm", max_new_tokens=10, return_token_ids=True,
                      thinking_token_budget=6,
                      inputs=[TokenPrompt(prompt_token_ids=open_prompt(reasoner, 2))])  # fmt: skip

    def ids(preempt_at: int | None) -> list[int]:
        (p,) = prepare(reasoner, request)
        d = Driver(reasoner)
        d.step([("pre", p)])
        for i in range(3):
            d.step(preempt=["pre"] if i == preempt_at else ())
        if preempt_at is not None:  # When it is preempted mid-reasoning and resumed
            assert "pre" in d.preempted
            d.step([("pre", p)])
        d.run()
        got: list[int] = d.finals["pre"].outputs[0]["token_ids"]
        return got

    # Then its resumed state counts the prompt's tokens again: the end comes at 4, as ever
    whole = ids(None)
    assert whole[4] == end and end not in whole[:4]
    assert ids(1) == whole


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
    # the prompt's newline after <think> (one token) is one of the two (vLLM counts it)
    start = lm.tokenizer.encode("<think>", add_special_tokens=False)
    ids = lm.tokenizer.encode(prompts[0], add_special_tokens=False)
    assert ids[-len(start) - 1 : -1] == start
    assert opened[1 : 1 + len(end)] == end
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


def test_a_chat_continuing_its_reasoning_counts_what_it_holds(
    reasoner: TextGenerationRunner,
) -> None:
    # Given a chat whose last assistant message opened its reasoning and holds some of it
    think, end = (reasoner.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    held = [*CHAT, {"role": "assistant", "content": "<think> the man was"}]

    def out(**kw: Any) -> dict[str, Any]:
        got = run(reasoner, chat("c", messages=held, continue_final_message=True,
                                 add_generation_prompt=False, **kw))  # fmt: skip
        return got["c"][0]

    free = out()
    prompt = free["prompt_token_ids"]
    n = len(prompt) - prompt.index(think) - 1  # the reasoning tokens it holds
    assert n >= 2 and end not in free["token_ids"]
    # When its budget is n + 2, Then 2 tokens are generated before the end is forced
    budgeted = out(thinking_token_budget=n + 2)["token_ids"]
    assert budgeted[:2] == free["token_ids"][:2] and budgeted[2] == end


def test_an_opening_tag_the_model_writes_after_a_closed_prompt_starts_the_count() -> None:
    # Given a prompt that closed its reasoning and a budget of 1
    rule = ThinkBudget(1, (E,), (S,), False)
    answer, opens_it = torch.zeros(16), torch.zeros(16)
    answer[X], opens_it[S] = 5.0, 5.0
    sampler = SeededSampler()
    sampler.add("s", Sampling(think=rule), [1])
    # When the model writes an answer token, then <think>, then goes on
    picks = [sampler.draw("s", logits) for logits in (answer, opens_it, answer, answer, answer)]
    # Then one reasoning token after its tag, the end forced, and its answer after
    assert picks == [X, S, X, E, X] and not sampler.forcing("s")
    # a resume (its output replayed) stands where it stood: forcing after <think> and one
    sampler.add("s", Sampling(think=rule), [1, X, S, X])
    assert sampler.forcing("s") and sampler.draw("s", answer) == E
