"""The chaos run's greedy check (``bench.gen_chaos_greedy``): a greedy answer's token
that one-at-a-time decoding did not choose is a violation, unless the two were tied
within ``TIE_EPS`` (a float32 tie), then it is reported apart; the steps after such a tie
are still checked. The reference, fed the answer's tokens, on the tests' tiny Llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gen_chaos_checks import Report
from bench.gen_chaos_greedy import TIE_EPS, RefStep, Verdict, judge, judged, reference_steps

S = RefStep


@pytest.mark.parametrize(
    ("tokens", "steps", "want"),
    [
        ([5, 6, 7], [S(5, 0.0), S(6, 0.0), S(7, 0.0)], Verdict(None, ())),
        # the float32 tie seen in a chaos run: top two logits 2.1e-6 apart
        ([5, 9, 7], [S(5, 0.0), S(6, 2.1e-6), S(7, 0.0)], Verdict(None, ((1, 2.1e-6),))),
        ([5, 9, 7], [S(5, 0.0), S(6, TIE_EPS), S(7, 0.0)], Verdict(None, ((1, TIE_EPS),))),
        ([5, 9, 7], [S(5, 0.0), S(6, 2 * TIE_EPS), S(7, 0.0)], Verdict(1, ())),
        ([5, 9, 7], [S(5, 0.0), S(6, 0.3), S(7, 0.0)], Verdict(1, ())),
        # a tie does not excuse what follows it
        ([5, 9, 8], [S(5, 0.0), S(6, 1e-6), S(7, 0.5)], Verdict(2, ((1, 1e-6),))),
        ([], [], Verdict(None, ())),
    ],
    ids=["same", "tie", "tie-at-eps", "past-eps", "choice", "after-a-tie", "empty"],
)
def test_a_greedy_answer_is_judged_strictly_but_for_float32_ties(
    tokens: list[int], steps: list[RefStep], want: Verdict
) -> None:
    assert judge(tokens, steps) == want


def test_reference_steps_must_match_the_tokens() -> None:
    with pytest.raises(ValueError, match="2 reference steps for 3 tokens"):
        judge([1, 2, 3], [S(1, 0.0), S(2, 0.0)])


def test_a_tie_is_reported_apart_and_a_real_difference_is_a_violation() -> None:
    report = Report()
    judged("tied", [5, 9], [S(5, 0.0), S(6, 2.1e-6)], report)
    assert report.violations == []
    assert report.ties == ["tied: token 1 is 9, one at a time gives 6, 2.1e-06 below it (a tie)"]
    assert report.counts["greedy answers with a tie broken otherwise"] == 1
    judged("off", [5, 9], [S(5, 0.0), S(6, 0.25)], report)
    assert report.violations == [
        "off: greedy token 1 is 9, one at a time gives 6 (0.25 below its top logit): [5, 9]"
    ]
    assert len(report.ties) == 1


def test_the_reference_fed_its_own_greedy_tokens_agrees_and_fed_another_says_how_far(
    tiny_lm: Path,
) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_lm).eval()
    prompt = [1, 17, 42, 99]
    # Given the model's own greedy tokens (each the argmax of the step before)
    tokens: list[int] = []
    for _ in range(6):
        tokens.append(reference_steps(lm, prompt, [*tokens, 0], torch)[-1].best)
    own = reference_steps(lm, prompt, tokens, torch)
    assert [s.best for s in own] == tokens and all(s.gap == 0.0 for s in own)
    assert judge(tokens, own) == Verdict(None, ())
    # When step 2 is fed the token the model likes least
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:2]])
        worst = int(lm(input_ids=ids).logits[0, -1].argmin())
    forced = [*tokens[:2], worst, *tokens[3:]]
    steps = reference_steps(lm, prompt, forced, torch)
    # Then that step is a violation far past a tie, and the steps before it agree
    assert steps[:2] == own[:2]
    assert steps[2].best == tokens[2] and steps[2].gap > 100 * TIE_EPS
    assert judge(forced, steps).bad == 2
