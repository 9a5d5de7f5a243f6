"""The paged engine (sliding-window models) scores prompts and serves LoRA adapters as the
padded engine does: prompt log-probabilities (chunked prefill, ``max_new_tokens`` 0, under
an adapter) equal the log-softmax of HF's forward over the whole prompt, and greedy tokens
under adapters, in one continuous batch with the base model's, equal PEFT's merged model's
``generate``; on a tiny Mistral and a tiny gpt-oss whose windows (8 tokens) are shorter
than their prompts, so the windowed path is the one that runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from devices import DEVICE
from test_generation_lora import (
    check_mixed_batch,
    check_preempted,
    make_adapter,
    make_other,
    merged,
)
from test_generation_runner import Driver, prepare, req
from tiny_models import make_causal_lm, make_gpt_oss

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from batchfleet.worker.generation.paged_step import Scored, plan  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402

OPTIONS = {"kv_cache_tokens": 1024, "page_size": 16, "step_tokens": 16, "max_running": 8}
"""A step budget of 16 tokens: the long prompts prefill in several chunks."""
LONG = "there were many years of time and the man was a b c it what is this " * 2
PROMPTS = ["the man was", LONG, "a b c d e f g h i j k the man was there", "it"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module", params=["mistral", "gpt-oss"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A sliding-window model and two adapters of it: ``sql`` (every projection it has as
    a linear layer, r 8) and ``chat`` (q and v, r 4, rsLoRA); the references: the base
    model loaded apart (a runner's model attends through transformers' paged kernels),
    and each adapter merged into it."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "mistral":  # every layer a sliding window of 8 tokens
        lm = make_causal_lm(root / "lm")
        base, every = make_other(root / "base", lm, "mistral", sliding_window=8), "all-linear"
    else:  # its experts are not linear layers: attention only
        base, every = make_gpt_oss(root / "base", window=8), ATTENTION
    adapters = {
        "sql": make_adapter(root / "sql", base, seed=1, targets=every),
        "chat": make_adapter(root / "chat", base, r=4, alpha=8, seed=2, use_rslora=True,
                             targets=["q_proj", "v_proj"]),
    }  # fmt: skip
    fresh = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    models = {None: fresh, **{k: merged(base, v) for k, v in adapters.items()}}
    models = {k: m.to(DEVICE) for k, m in models.items()}  # the runner's device
    return SimpleNamespace(base=base, adapters=adapters, models=models)


def _runner(family: Any, **opts: Any) -> TextGenerationRunner:
    named = {k: str(v) for k, v in family.adapters.items()}
    runner = TextGenerationRunner(family.base, device=DEVICE, dtype="float32",
                                  options=OPTIONS | {"lora_adapters": named} | opts)  # fmt: skip
    assert runner.engine_kind == "paged"  # chosen for the window
    return runner


@pytest.fixture(scope="module")
def runner(family: Any) -> TextGenerationRunner:
    return _runner(family)


def _generate(family: Any, runner: TextGenerationRunner, lora: str | None, text: str,
              n: int) -> list[int]:  # fmt: skip
    model = family.models[lora]
    ids = runner.tokenizer(text, return_tensors="pt").input_ids.to(model.device)
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=runner.eos[0],
                         eos_token_id=model.config.vocab_size)  # fmt: skip
    return [int(t) for t in out[0, ids.shape[1] :]]


def _log_softmax(family: Any, lora: str | None, ids: list[int]) -> Any:
    with torch.inference_mode():
        model = family.models[lora]
        logits = model(torch.tensor([ids], device=model.device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def _check_scores(family: Any, runner: TextGenerationRunner, lora: str | None, text: str,
                  out: dict[str, Any], top: int) -> None:  # fmt: skip
    """``out``'s prompt log-probabilities are HF's whole-prompt forward's."""
    ids = runner.tokenizer(text).input_ids
    scored = out["prompt_logprobs"]
    assert scored[0] is None and len(scored) == out["prompt_tokens"] == len(ids)
    lp = _log_softmax(family, lora, ids)
    assert [e["token"] for e in scored[1:]] == ids[1:]
    assert [e["logprob"] for e in scored[1:]] == pytest.approx(
        [float(lp[k, t]) for k, t in enumerate(ids[1:])], abs=1e-4
    )
    for k, e in enumerate(scored[1:]):  # the likeliest tokens, each with its own
        assert [t["logprob"] for t in e["top"]] == pytest.approx(
            torch.topk(lp[k], top).values.tolist(), abs=1e-4
        )
        assert [t["logprob"] for t in e["top"]] == pytest.approx(
            [float(lp[k, t["token"]]) for t in e["top"]], abs=1e-4
        )


def test_prompt_logprobs_through_chunks_equal_the_whole_prompt_forward(
    family: Any, runner: TextGenerationRunner
) -> None:
    # Given: prompts longer than the window and than a step's budget (chunked prefill),
    # scored with max_new_tokens 0 and 1 (n 2: only each input's first completion is
    # scored), beside a plain request that generates
    long = len(runner.tokenizer(LONG).input_ids)
    assert long > 3 * OPTIONS["step_tokens"]
    zero = req("z", inputs=PROMPTS[:3], max_new_tokens=0, n=2, prompt_logprobs=3,
               return_token_ids=True)  # fmt: skip
    one = req("o", inputs=[LONG], max_new_tokens=1, prompt_logprobs=2, return_token_ids=True)
    plain = req("p", inputs=[PROMPTS[2]], max_new_tokens=6, ignore_eos=True,
                return_token_ids=True)  # fmt: skip
    d = Driver(runner)
    d.step(list(zip(["z", "o", "p"], prepare(runner, zero, one, plain), strict=True)))
    d.run()
    # Then: each input's scores are those of HF's forward over its whole prompt
    outs = d.finals["z"].outputs
    for i, text in enumerate(PROMPTS[:3]):
        first, second = outs[2 * i], outs[2 * i + 1]
        _check_scores(family, runner, None, text, first, 3)
        assert "prompt_logprobs" not in second
        assert first["token_ids"] == second["token_ids"] == []
    (o,) = d.finals["o"].outputs
    _check_scores(family, runner, None, LONG, o, 2)
    assert o["token_ids"] == _generate(family, runner, None, LONG, 1)
    assert d.finals["p"].outputs[0]["token_ids"] == _generate(family, runner, None, PROMPTS[2], 6)


def test_adapters_and_the_base_in_one_batch_give_the_merged_models_tokens(
    family: Any, runner: TextGenerationRunner
) -> None:
    check_mixed_batch(runner, lambda lora, text, n: _generate(family, runner, lora, text, n))


def test_a_prompt_scored_under_an_adapter_is_scored_by_the_merged_model(
    family: Any, runner: TextGenerationRunner
) -> None:
    reqs = [req(f"s{i}", inputs=[LONG], max_new_tokens=0, prompt_logprobs=1, lora=lora)
            for i, lora in enumerate([None, "sql", "chat"])]  # fmt: skip
    d = Driver(runner)
    d.step(list(zip([r.id for r in reqs], prepare(runner, *reqs), strict=True)))
    d.run()
    outs = [d.finals[r.id].outputs[0] for r in reqs]
    for r, out in zip(reqs, outs, strict=True):
        _check_scores(family, runner, r.lora, LONG, out, 1)
    assert outs[0]["prompt_logprobs"] != outs[1]["prompt_logprobs"] != outs[2]["prompt_logprobs"]


def test_a_request_preempted_under_an_adapter_resumes_under_it(
    family: Any, runner: TextGenerationRunner
) -> None:
    check_preempted(runner, lambda lora, text, n: _generate(family, runner, lora, text, n))


def test_padded_step_inputs_take_the_adapters_and_scores_too(family: Any) -> None:
    """transformers pads a step's inputs where it replays CUDA graphs, and the forwards
    with an adapter or a score run eagerly on those padded inputs: the labels cover the
    padding, the scored rows are the real tokens', and no graph is made or replayed for
    them."""
    runner = _runner(family)
    engine: Any = runner.engine
    engine.processor.model_runner.pad_inputs = True
    reqs = [req("a", inputs=[LONG], max_new_tokens=5, lora="sql", ignore_eos=True,
                return_token_ids=True, prompt_logprobs=1),
            req("b", inputs=[PROMPTS[2]], max_new_tokens=7, ignore_eos=True,
                return_token_ids=True)]  # fmt: skip
    d = Driver(runner)
    d.step(list(zip(["a", "b"], prepare(runner, *reqs), strict=True)))
    d.run()
    a, b = d.finals["a"].outputs[0], d.finals["b"].outputs[0]
    assert a["token_ids"] == _generate(family, runner, "sql", LONG, 5)
    _check_scores(family, runner, "sql", LONG, a, 1)
    assert b["token_ids"] == _generate(family, runner, None, PROMPTS[2], 7)
    # With its CUDA graphs on (none can be made on a CPU), steps with an adapter's token
    # run eagerly all the same, and leave the graphs on for the others
    model_runner = engine.processor.model_runner
    model_runner.use_cuda_graph_varlen = model_runner.use_cuda_graph_decode = True
    (c,) = prepare(runner, req("c", inputs=[PROMPTS[0]], max_new_tokens=4, lora="chat",
                               ignore_eos=True, return_token_ids=True))  # fmt: skip
    d.step([("c", c)])
    d.run()
    assert d.finals["c"].outputs[0]["token_ids"] == _generate(family, runner, "chat", PROMPTS[0], 4)
    assert model_runner.use_cuda_graph_varlen and model_runner.use_cuda_graph_decode


def test_an_adapter_loaded_while_serving_is_served_and_the_base_untouched(family: Any) -> None:
    runner = TextGenerationRunner(family.base, device=DEVICE, dtype="float32", options=OPTIONS)
    d = Driver(runner)
    (p0,) = prepare(runner, req("r0", inputs=[PROMPTS[0]], max_new_tokens=8, ignore_eos=True,
                                return_token_ids=True))  # fmt: skip
    d.step([("r0", p0)])
    runner.load_lora("chat", family.adapters["chat"])
    (p1,) = prepare(runner, req("r1", inputs=[PROMPTS[2]], max_new_tokens=6, lora="chat",
                                ignore_eos=True, return_token_ids=True))  # fmt: skip
    d.step([("r1", p1)])
    d.run()
    assert d.finals["r0"].outputs[0]["token_ids"] == _generate(family, runner, None, PROMPTS[0], 8)
    assert d.finals["r1"].outputs[0]["token_ids"] == _generate(
        family, runner, "chat", PROMPTS[2], 6
    )
    runner.unload_lora("chat")
    d.step()
    assert runner.engine.adapters == ()  # type: ignore[attr-defined]


def _future(name: str, past: int, q: int) -> Any:
    state = SimpleNamespace(request_id=name, position_offset=past + q)
    return SimpleNamespace(state=state, query_length=q)


def test_the_step_plan_scores_each_prompt_position_once_and_labels_each_token() -> None:
    # Given: "s" (6 prompt tokens) scored, "t" under adapter 2, "u" plain
    s = Scored([10, 11, 12, 13, 14, 15], 1)
    batch = [_future("u", 7, 1), _future("s", 0, 4), _future("t", 3, 2)]
    # When: a step runs s's first chunk (positions 0-3) beside a decode and a chunk
    step = plan(batch, 9, {"t": 2}, {"s": s})
    # Then: s's positions 0-3 are the forward's tokens 1-4; t's tokens take label 2,
    # the padding none
    assert step is not None
    assert step.labels == [0, 0, 0, 0, 0, 2, 2, 0, 0]
    assert step.positions == [1, 2, 3, 4] and step.spans == [(s, 0, 4)]
    # When: its 4 scores are kept and its last chunk runs (positions 4-5 and the first
    # generated token's), alone
    s.kept += [(t, 0.0, [], []) for t in s.tokens[1:5]]
    step = plan([_future("s", 4, 2)], 2, {}, {"s": s})
    # Then: only position 4 predicts a prompt token
    assert step is not None and step.positions == [0] and step.spans == [(s, 4, 5)]
    # and once scored, nothing is left to add
    s.kept.append((15, 0.0, [], []))
    assert plan([_future("s", 6, 1)], 1, {}, {"s": s}) is None
    # A chunk run again from the start (a reset) scores only what is not scored yet
    again = Scored([1, 2, 3, 4], 0, [(2, 0.0, [], [])])
    step = plan([_future("x", 0, 4)], 4, {}, {"x": again})
    assert step is not None and step.positions == [1, 2] and step.spans == [(again, 1, 3)]
    # A gap (positions prefilled unscored) is an error, not misplaced scores
    with pytest.raises(RuntimeError, match="prefilled unscored"):
        plan([_future("y", 2, 2)], 2, {}, {"y": Scored([1, 2, 3, 4, 5], 0)})
