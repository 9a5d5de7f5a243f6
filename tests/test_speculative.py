"""N-gram speculative decoding in the padded engine: the proposer's matches; greedy
tokens exactly those of the engine without speculation and of one-at-a-time ``generate``
(prompts that repeat themselves, so drafts are proposed and both accepted and rejected),
through the lean fused step and transformers' forwards; rejection sampling emits each
token with its probability under the processed distribution; seeded runs repeat; the
rules, log-probabilities, ``max_new_tokens`` and end-of-sequence hold per emitted token."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from batchfleet.worker.generation.padded import PaddedEngine  # noqa: E402
from batchfleet.worker.generation.sampling import (  # noqa: E402
    Sampling,
    SeededSampler,
    distribution,
    judge,
)
from batchfleet.worker.generation.speculative import NgramConfig, ngram_drafts, parse  # noqa: E402
from devices import DEVICE  # noqa: E402
from test_padded_engine import EOS, _until_done, generate, run, tiny_gpt2, tiny_llama  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """test_padded_engine's tiny Llama, on the tests' device."""
    return tiny_llama(tmp_path_factory).to(DEVICE)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """test_padded_engine's tiny GPT-2, on the tests' device."""
    return tiny_gpt2(tmp_path_factory).to(DEVICE)


# --- the proposer -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens,low,high,k,want",
    [
        ([1, 2, 3, 4, 2, 3], 2, 2, 4, [4, 2, 3]),  # vLLM's docstring example
        ([1, 2, 3, 4, 2, 3], 1, 3, 2, [4, 2]),
        ([1, 2, 3, 4, 5], 1, 3, 3, []),  # the last token never occurred before
        ([7, 1, 2, 9, 1, 2, 8, 5, 2], 1, 3, 2, [9, 1]),  # only "2" matches: its first place
        ([5, 1, 2, 9, 6, 1, 2, 7, 1, 2], 2, 3, 1, [9]),  # "1 2" twice: the first
        ([5, 1, 2, 9, 6, 6, 1, 2, 7, 6, 1, 2], 2, 3, 1, [7]),  # "6 1 2" is longer
        ([5, 1, 2, 9, 6, 6, 1, 2, 7, 6, 1, 2], 2, 2, 1, [9]),  # ... unless max is 2
        ([3, 3, 3], 1, 4, 5, [3]),  # overlapping: what follows the first "3 3"
        ([4, 4], 1, 1, 3, [4]),
        ([4], 1, 1, 3, []),
        ([1, 2, 1, 2], 3, 4, 2, []),  # "2 1 2" is not earlier: below the minimum
    ],
)
def test_ngram_drafts_follow_the_longest_earlier_match(
    tokens: list[int], low: int, high: int, k: int, want: list[int]
) -> None:
    assert ngram_drafts(np.asarray(tokens), low, high, k) == want


def test_propose_caps_the_drafts_at_the_limit() -> None:
    spec = NgramConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    assert spec.drafts([1, 2, 3, 4, 5, 1], 10) == [2, 3, 4]
    assert spec.drafts([1, 2, 3, 4, 5, 1], 2) == [2, 3]
    assert spec.drafts([1, 2, 3, 4, 5, 1], 0) == []
    rows = [("a", [1, 2, 3, 4, 5, 1], 10), ("b", [5, 6], 9), ("c", [7, 8, 7], 9), ("d", [1, 1], 9)]
    assert spec.propose(rows, 5) == [[2, 3, 4], [], [8, 7], []]  # the budget: 5 in all


@pytest.mark.parametrize(
    "raw,error",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            r"prompt_lookup_min=3 must be <= prompt_lookup_max=2",
        ),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max: 0"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": "3"}, "prompt_lookup_min: '3'"),
        ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
        ("ngram", "a table"),
    ],
)
def test_the_option_is_checked(raw: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse(raw)


@pytest.mark.parametrize(
    "given,low,high",
    [
        ({}, 5, 5),  # neither: vLLM's 5 and 5
        ({"prompt_lookup_min": None, "prompt_lookup_max": None}, 5, 5),  # JSON nulls: unset
        ({"prompt_lookup_min": 2}, 2, 2),  # only min: max = min
        ({"prompt_lookup_min": 7}, 7, 7),
        ({"prompt_lookup_max": 3}, 3, 3),  # only max: min = max
        ({"prompt_lookup_max": 8, "prompt_lookup_min": None}, 8, 8),
        ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, 1, 4),  # both: as given
    ],
)
def test_the_lookup_bounds_default_as_vllm_s(given: dict[str, Any], low: int, high: int) -> None:
    spec = NgramConfig.parse({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (low, high)
    assert spec == NgramConfig(3, low, high)


# --- greedy: exactly the tokens without speculation ------------------------------------


def _repetitive(model: Any, count: int, seed: int) -> list[tuple[str, list[int], int]]:
    """Prompts that repeat a short phrase (cut anywhere), a few of its tokens changed:
    the model's greedy text repeats parts of them, so drafts are proposed, accepted and
    (where an earlier occurrence went on differently) rejected."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    out = []
    for i in range(count):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 8))]
        prompt = [t if rng.random() > 0.15 else rng.randrange(3, vocab)
                  for t in (phrase * 8)[: rng.randint(3, 45)]]  # fmt: skip
        out.append((f"s{i}", prompt, rng.randint(1, 40)))
    return out


def _run(engine: PaddedEngine, seqs: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    """Step until all finished, the sequences arriving three steps apart."""
    return run(engine, {3 * i: [s] for i, s in enumerate(seqs)})


@pytest.mark.parametrize(
    "which,lean,row_attention",
    [("llama", True, True), ("llama", True, False), ("llama", False, True),
     ("llama", False, False), ("gpt2", False, True)],
    ids=["lean-rows", "lean-sdpa", "transformers-rows", "transformers-sdpa", "gpt2"],
)  # fmt: skip
def test_greedy_speculation_gives_exactly_the_tokens_without_it(
    which: str, lean: bool, row_attention: bool, request: pytest.FixtureRequest
) -> None:
    model = request.getfixturevalue(which)
    seqs = _repetitive(model, 16, seed=4)

    def engine(spec: NgramConfig | None) -> PaddedEngine:
        return PaddedEngine(model, eos_token_ids=[EOS], step_tokens=40, max_running=5,
                            lean=lean, row_attention=row_attention, speculative=spec)  # fmt: skip

    plain = _run(engine(None), seqs)
    spec = engine(NgramConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                              prompt_lookup_max=3))  # fmt: skip
    assert (spec.lean is not None) is lean
    got = _run(spec, seqs)
    assert got == plain
    for name, prompt, n in seqs:
        assert got[name] == generate(model, prompt, n), name
    rows, drafts = spec.drafted
    accepted = sum(spec.accepted)
    assert rows and 0 < accepted < drafts  # drafts were accepted and rejected
    assert spec.accepted == sorted(spec.accepted, reverse=True)  # a position after a rejection
    assert not spec._rows and spec.running == 0


def test_speculation_respects_max_new_tokens_eos_and_the_step_budget(llama: Any) -> None:
    seqs = _repetitive(llama, 10, seed=5)
    plain = _run(PaddedEngine(llama, eos_token_ids=[EOS], step_tokens=40, max_running=5), seqs)
    # a tight budget: 5 rows leave 3 draft tokens a step (1 while one waits)
    engine = PaddedEngine(llama, eos_token_ids=[EOS], step_tokens=8, max_running=5,
                          speculative=NgramConfig(6, 1, 4))  # fmt: skip
    widths: list[int] = []
    real = engine.lean.forward  # type: ignore[union-attr]

    def counted(ids: Any, positions: Any, lengths: Any, caches: Any, chunks: Any,
                *args: Any) -> Any:  # fmt: skip
        widths.append(ids.shape[0] + sum(len(c.tokens) for c in chunks))
        return real(ids, positions, lengths, caches, chunks, *args)

    engine.lean.forward = counted  # type: ignore[union-attr, method-assign]
    got = _run(engine, seqs)
    assert got == plain
    for name, _, n in seqs:
        assert len(got[name]) <= n
        assert EOS not in got[name][:-1]
    assert max(widths) <= 8 and engine.drafted[1] > 0


def test_a_row_that_proposes_nothing_costs_no_draft(llama: Any) -> None:
    engine = PaddedEngine(llama, eos_token_ids=[EOS], step_tokens=40, max_running=5,
                          speculative=NgramConfig(4, 2, 3))  # fmt: skip
    engine.add("a", [5, 6, 7, 5, 6, 7, 5, 6], 1, Sampling())  # one token: nothing to draft
    while engine.running or engine._waiting:
        engine.step()
    assert engine.drafted == [0, 0]


# --- sampling ----------------------------------------------------------------------------


def test_rejection_sampling_emits_each_token_with_its_probability() -> None:
    # Given: a 6-token vocabulary, temperature and top-k shaping the distribution
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    sampling = Sampling(temperature=0.7, top_k=5)
    p = distribution(logits, sampling).double().numpy()
    assert p[4] == 0.0  # outside the top 5
    gen = torch.Generator().manual_seed(1234)
    draws = 40_000
    for draft in (0, 3, 4):  # likely, unlikely, impossible
        # When: the draft is judged many times
        counts = np.bincount([judge(logits, sampling, gen, draft) for _ in range(draws)],
                             minlength=6)  # fmt: skip
        # Then: each token comes with its own probability (chi-square, 4 degrees of
        # freedom over the 5 possible tokens: 18.5 is the 0.1% level)
        assert counts[4] == 0
        live = p > 0
        expected = p[live] * draws
        chi2 = float((((counts[live] - expected) ** 2) / expected).sum())
        assert chi2 < 18.5, (draft, counts, expected)


def test_verify_accepts_a_certain_draft_and_replaces_an_impossible_one() -> None:
    sampler = SeededSampler([EOS])
    sampler.add("s", Sampling(temperature=1.0, seed=3), [9, 9])
    certain = torch.full((3, 8), -1e9)
    certain[0, 5] = certain[1, 6] = certain[2, 7] = 0.0  # each position: one token
    assert sampler.verify("s", certain, [5, 6]) == [5, 6, 7]
    assert sampler.verify("s", certain, [5, 1]) == [5, 6]  # 1 is impossible: 6 instead
    assert sampler.verify("s", certain, [EOS, 6], frozenset({EOS})) == [5]
    certain[0, EOS] = 0.0
    certain[0, 5] = -1e9
    assert sampler.verify("s", certain, [EOS, 6], frozenset({EOS})) == [EOS]  # nothing after


def _sampled(model: Any, spec: NgramConfig | None, seed: int, **kw: Any) -> dict[str, list[int]]:
    engine = PaddedEngine(model, eos_token_ids=[EOS], step_tokens=40, max_running=5,
                          speculative=spec)  # fmt: skip
    seqs = _repetitive(model, 6, seed=9)
    for name, prompt, n in seqs:
        engine.add(name, prompt, n, Sampling(temperature=0.3, seed=seed + int(name[1:]), **kw))
    return _until_done(engine)


def test_seeded_sampling_with_speculation_repeats(llama: Any) -> None:
    spec = NgramConfig(3, 1, 3)
    first = _sampled(llama, spec, seed=11)
    assert _sampled(llama, spec, seed=11) == first
    assert _sampled(llama, spec, seed=12) != first


def test_rules_and_logprobs_see_every_emitted_token(llama: Any) -> None:
    # greedy under a penalty, a bias and min_new_tokens: each position's processed
    # logits depend on the tokens emitted before it, in the same step too
    rules = Sampling(repetition_penalty=1.3, frequency_penalty=0.4, min_new_tokens=6,
                     logit_bias=((7, 2.0),), logprobs=2)  # fmt: skip
    seqs = _repetitive(llama, 8, seed=13)
    runs = []
    for spec in (None, NgramConfig(4, 1, 3)):
        engine = PaddedEngine(llama, eos_token_ids=[EOS], step_tokens=40, max_running=5,
                              speculative=spec)  # fmt: skip
        for name, prompt, n in seqs:
            engine.add(name, prompt, n, rules)
        done = _until_done(engine)
        kept = {name: engine.logprobs(name) for name in done}
        runs.append((done, kept, engine.drafted[1]))
    (plain, plain_lps, _), (got, lps, drafted) = runs
    assert drafted > 0
    assert got == plain
    for name, tokens in got.items():
        assert [t for t, *_ in lps[name]] == tokens  # one entry per emitted token
        for (_, a, ids_a, *_), (_, b, ids_b, *_) in zip(lps[name], plain_lps[name], strict=True):
            assert a == pytest.approx(b, abs=1e-4) and ids_a == ids_b


# --- through the runner ----------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


def _runner(lm_dir: Any, **opts: Any) -> Any:
    from batchfleet.worker.runners.generation import TextGenerationRunner

    base = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 8}
    return TextGenerationRunner(lm_dir, device=DEVICE, dtype="float32", options={**base, **opts})


def _answers(runner: Any, requests: list[Any]) -> tuple[dict[str, Any], list[Any], dict[str, str]]:
    """Each request's outputs, the step reports, and each streamed request's delta text."""
    from batchfleet.worker.runner import Final, Partial, Work

    preps = runner.prepare_many(requests)
    admit = tuple((r.id, p) for r, p in zip(requests, preps, strict=True))
    finals: dict[str, Any] = {}
    streamed: dict[str, str] = {}
    reports = []
    for n in range(300):
        report = runner.step(Work(f"s{n}", admit))
        admit = ()
        reports.append(report)
        report.settle()
        for ev in report.events:
            if isinstance(ev, Final):
                finals[ev.key] = ev.outputs
            elif isinstance(ev, Partial):
                at = f"{ev.key}/{ev.chunk['input']}"
                streamed[at] = streamed.get(at, "") + ev.chunk["text"]
        if len(finals) == len(requests):
            return finals, reports, streamed
    raise AssertionError("did not finish")


SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 6}},
    "required": ["name", "tags"],
    "additionalProperties": False,
}  # fmt: skip


def test_the_runner_s_answers_are_those_without_speculation(lm_dir: Any) -> None:
    from batchfleet.schemas.messages import Request

    plain_runner, spec_runner = _runner(lm_dir), _runner(lm_dir, speculative=SPEC)
    text = "a b c a b c a b"  # its greedy text: " b b b ... b" then other runs
    full = _answers(
        plain_runner,
        [Request(id="f", model="lm", inputs=[text], max_new_tokens=40, return_token_ids=True)],
    )[0]["f"]
    ids, out = full[0]["token_ids"], full[0]["text"]
    # a stop string and a stop token where a run ends (where a draft is rejected)
    at = next(i for i in range(10, len(out)) if out[i] != out[i - 1])
    stop = out[at - 1 : at + 1]
    inner = out[1:5]  # "b b ": inside the first run, where a step's drafts go past it
    stop_id = next(t for j, t in enumerate(ids) if j > 5 and t != ids[j - 1])

    def requests() -> list[Request]:
        return [
            Request(id="len", model="lm", inputs=[text, "what is this"], max_new_tokens=30,
                    logprobs=2, stream=True, return_token_ids=True),
            Request(id="inner", model="lm", inputs=[text], max_new_tokens=40, stop=[inner],
                    stream=True, return_token_ids=True),
            Request(id="stop", model="lm", inputs=[text], max_new_tokens=40, stop=[stop],
                    stream=True, return_token_ids=True),
            Request(id="ids", model="lm", inputs=[text], max_new_tokens=40,
                    stop_token_ids=[stop_id], return_token_ids=True),
            Request(id="json", model="lm", inputs=[text], max_new_tokens=60,
                    structured_outputs={"json": PERSON}, return_token_ids=True),
            Request(id="n", model="lm", inputs=[text], max_new_tokens=25, n=2,
                    temperature=0.5, seed=4, min_new_tokens=5, logprobs=1),
        ]  # fmt: skip

    plain, _, plain_streamed = _answers(plain_runner, requests())
    got, reports, streamed = _answers(spec_runner, requests())
    for key in ("len", "inner", "stop", "ids", "json"):
        for a, b in zip(got[key], plain[key], strict=True):
            lps_a, lps_b = a.pop("logprobs", []), b.pop("logprobs", [])
            del a["cached_tokens"], b["cached_tokens"]  # (only the plain runner ran "f")
            assert a == b, key
            assert [x["token"] for x in lps_a] == [x["token"] for x in lps_b]
            for x, y in zip(lps_a, lps_b, strict=True):  # the verify forward's rounding
                assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
    assert got["stop"][0]["finish_reason"] == "stop" and got["stop"][0]["stop_reason"] == stop
    assert streamed == plain_streamed
    assert streamed["stop/0"] == got["stop"][0]["text"] and got["stop"][0]["text"]
    assert got["inner"][0]["stop_reason"] == inner and got["inner"][0]["completion_tokens"] == 3
    assert got["ids"][0]["token_ids"][-1] == stop_id and got["ids"][0]["finish_reason"] == "stop"
    for out in got["n"]:  # one log-probability per token
        assert len(out["logprobs"]) == out["completion_tokens"]
    assert [o["completion_tokens"] for o in got["n"]] <= [25, 25]
    # the steps gave several tokens a row, and reported the drafts
    drafts = sum(r.drafted[1] for r in reports)
    accepted = sum(sum(r.accepted) for r in reports)
    assert sum(r.drafted[0] for r in reports) and 0 < accepted <= drafts
    assert len(reports) < len(_answers(plain_runner, requests())[1])
    info = spec_runner.info()
    assert info["speculative"] == {"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3}  # fmt: skip
    assert info["spec_decode_draft_tokens"] >= drafts


def test_the_runner_checks_the_option(lm_dir: Any) -> None:
    with pytest.raises(ValueError, match=r"options\.speculative\.num_speculative_tokens"):
        _runner(lm_dir, speculative={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="padded engine"):
        _runner(lm_dir, speculative=SPEC, engine="paged")
    assert _runner(lm_dir).speculative is None


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_lora_rows_speculate_under_their_own_adapter(
    lean: bool, lm_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytest.importorskip("peft")
    from batchfleet.schemas.messages import Request
    from test_generation_lora import sql_and_chat

    adapters = {k: str(v) for k, v in sql_and_chat(lm_dir, tmp_path_factory.mktemp("a")).items()}
    runs = []
    for spec in (None, SPEC):
        runner = _runner(lm_dir, lora_adapters=adapters, lean_decode=lean, speculative=spec)
        reqs = [Request(id=f"r{i}", model="lm", inputs=[p], max_new_tokens=30, lora=lora,
                        ignore_eos=True, return_token_ids=True)
                for i, (lora, p) in enumerate([(None, "a b c a b c a b"), ("sql", "a b c a b c"),
                                               ("chat", "it was the time of the year"),
                                               ("sql", "we can do all that we can do")])]  # fmt: skip
        finals, reports, _ = _answers(runner, reqs)
        runs.append(({k: v[0]["token_ids"] for k, v in finals.items()},
                     sum(sum(r.accepted) for r in reports)))  # fmt: skip
    (plain, _), (got, accepted) = runs
    assert got == plain and accepted > 0


def test_the_spec_decode_counters_add_up_the_steps() -> None:
    from batchfleet.worker.metrics import Metrics, PrometheusObserver
    from batchfleet.worker.observers import Generated
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    obs = PrometheusObserver(Metrics(registry))
    obs.notify(Generated("m", 3, 0, 100, 1000, 0, tokens=9, drafted=(3, 10), accepted=(3, 2, 1)))
    obs.notify(Generated("m", 3, 0, 100, 1000, 0, tokens=3))  # no speculation: no change
    obs.notify(Generated("m", 3, 0, 100, 1000, 0, tokens=4, drafted=(1, 4), accepted=(1, 0, 0, 0)))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name + "_total", {"model": "m", **labels})

    assert value("batchfleet_spec_decode_num_drafts") == 4
    assert value("batchfleet_spec_decode_num_draft_tokens") == 14
    assert value("batchfleet_spec_decode_num_accepted_tokens") == 7
    per_pos = [value("batchfleet_spec_decode_num_accepted_tokens_per_pos", position=str(p))
               for p in range(4)]  # fmt: skip
    assert per_pos == [4, 2, 1, 0]


def test_the_worker_s_stats_and_batchfleet_status_show_the_acceptance() -> None:
    from batchfleet.worker.observers import Generated
    from batchfleet.worker.stats import LoopStats
    from rich.console import Console

    from batchfleet.status import FleetStatus, ModelStatus, render

    stats = LoopStats("m", 3)
    stats.notify(Generated("m", 3, 0, 100, 1000, 0, tokens=3))
    assert "spec_acceptance" not in stats.snapshot()["generation"]  # nothing proposed
    stats.notify(Generated("m", 3, 0, 100, 1000, 0, tokens=9, drafted=(3, 10), accepted=(3, 2, 1)))
    stats.notify(Generated("m", 3, 0, 100, 1000, 0, tokens=2, drafted=(1, 2), accepted=(0, 0)))
    gen = stats.snapshot()["generation"]
    assert (gen["spec_draft_tokens"], gen["spec_accepted_tokens"], gen["spec_acceptance"]) == (
        12, 6, 0.5)  # fmt: skip
    status = FleetStatus([ModelStatus("m", [], {"c1": 1.0}, 0)],
                         {"w1": {"m": {"consumer": "c1", "generation": gen}}})  # fmt: skip
    assert status.worker_rows()[0]["spec_acceptance"] == 0.5
    console = Console(width=200, record=True)
    console.print(render(status))
    text = console.export_text()
    assert "spec accept" in text and "50%" in text
