# ruff: noqa: F811  (the runner fixture is imported from test_generation_logits)
"""A generation request's ``n`` (completions per input) through the runner on both
engines: ``n`` outputs per input, input by input, each completion its own sequence (with a
seed, completion ``j`` draws from ``seed + j``), streamed under its output's index, across
a preemption; and the request's bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

torch = pytest.importorskip("torch")

from batchfleet.schemas.messages import MAX_COMPLETIONS, Limits, Request  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from test_generation_logits import lm_dir, runner  # noqa: E402, F401  (fixtures)
from test_generation_runner import PROMPTS, Driver, greedy, prepare, req  # noqa: E402

SAMPLED = {"temperature": 1.5, "seed": 11, "max_new_tokens": 10}


def texts(d: Driver, key: str) -> list[str]:
    return [str(o["text"]) for o in d.finals[key].outputs]


def alone(runner: TextGenerationRunner, prompt: str, **fields: object) -> str:
    (p,) = prepare(runner, req("one", inputs=[prompt], **fields))
    d = Driver(runner)
    d.step([("one", p)])
    d.run()
    return texts(d, "one")[0]


def test_n_completions_per_input_each_drawn_from_its_own_seed(
    runner: TextGenerationRunner,
) -> None:
    (p,) = prepare(runner, req("n", inputs=PROMPTS[:2], n=3, **SAMPLED))
    assert p.rows == 6 and p.prompts == (p.prompts[0],) * 3 + (p.prompts[3],) * 3
    d = Driver(runner)
    d.step([("n", p)])
    d.run()
    outs = texts(d, "n")
    assert len(outs) == 6
    if runner.engine_kind == "padded":  # each prompt ran once, its other completions took it
        lengths = p.prompts[0] + p.prompts[3]
        info = runner.info()
        assert (info["prefill_tokens"], info["prefill_shared_tokens"]) == (lengths, 2 * lengths)
    # input i's completion j is output i * 3 + j, and is what seed + j gives alone
    for i in range(2):
        for j in range(3):
            assert outs[i * 3 + j] == alone(runner, PROMPTS[i], **{**SAMPLED, "seed": 11 + j})
        assert len(set(outs[i * 3 : i * 3 + 3])) > 1  # completions differ
    assert outs[0] == alone(runner, PROMPTS[0], **SAMPLED)  # n=1's text is completion 0's
    usage = [(o["prompt_tokens"], o["completion_tokens"]) for o in d.finals["n"].outputs]
    assert all(pt == p.prompts[0] for pt, _ in usage[:3]) and all(ct == 10 for _, ct in usage)


def test_greedy_completions_are_the_greedy_text(runner: TextGenerationRunner) -> None:
    (p,) = prepare(runner, req("g", inputs=[PROMPTS[2]], n=2, max_new_tokens=7))
    d = Driver(runner)
    d.step([("g", p)])
    d.run()
    assert texts(d, "g") == [greedy(runner, PROMPTS[2], 7)] * 2


def test_completions_stream_under_their_output_s_index_and_survive_a_preemption(
    runner: TextGenerationRunner,
) -> None:
    def run(preempt: bool) -> Driver:
        (p,) = prepare(runner, req("s", inputs=PROMPTS[:2], n=2, stream=True, **SAMPLED))
        d = Driver(runner)
        d.step([("s", p)])
        d.step()
        if preempt:
            d.step(preempt=["s"])
            assert "s" in d.preempted and len(d.preempted["s"].prompts) == 4
            d.step([("s", p)])
        d.run()
        return d

    straight, preempted = run(False), run(True)
    assert texts(preempted, "s") == texts(straight, "s")
    for d in (straight, preempted):
        chunks = d.partials["s"]
        assert {c["input"] for c in chunks} == {0, 1, 2, 3}
        for k, out in enumerate(d.finals["s"].outputs):
            mine = [c for c in chunks if c["input"] == k]
            assert "".join(c["text"] for c in mine) == out["text"]
            assert sum(c["tokens"] for c in mine) == out["completion_tokens"]


def test_n_is_bounded() -> None:
    assert Request(id="a", model="m", inputs=["x"], n=MAX_COMPLETIONS).output_count == 16
    for bad in (0, MAX_COMPLETIONS + 1):
        with pytest.raises(ValidationError):
            Request(id="a", model="m", inputs=["x"], n=bad)
    limits = {"limits": Limits(max_inputs=8)}
    chat = [{"role": "user", "content": "hi"}]
    assert Request.model_validate({"id": "a", "model": "m", "messages": chat, "n": 8},
                                  context=limits).output_count == 8  # fmt: skip
    with pytest.raises(ValidationError, match="too_large: 3 inputs x n 3 = 9 outputs"):
        Request.model_validate({"id": "a", "model": "m", "inputs": ["x"] * 3, "n": 3},
                               context=limits)  # fmt: skip
