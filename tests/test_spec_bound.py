"""Speculation bounded by the batch's size (vLLM's ``disable_by_batch_size`` and
``num_speculative_tokens_per_batch_size``) and vLLM's other ``SpeculativeConfig`` keys: the
bound's table by running count; in the padded engine, no drafts (and no proposer call)
in a step where the bound allows none, drafts where it allows them, switching as
sequences join and leave, greedy tokens exactly those without speculation (n-gram and a
draft model); the running count is vLLM V1's, the sequences the step before ran (its
new prefills, and a request's ``n`` completions waiting on one prefill, too); the
runner's ``info()`` and the Prometheus counter of rows that skipped; the keys taken,
taken as they are, and refused."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchfleet.worker.generation.draft import DraftProposer  # noqa: E402
from batchfleet.worker.generation.padded import PaddedEngine  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling  # noqa: E402
from batchfleet.worker.generation.spec_bound import BatchBound  # noqa: E402
from batchfleet.worker.generation.speculative import (  # noqa: E402
    DraftConfig,
    NgramConfig,
    Proposer,
    Row,
    parse,
)
from devices import DEVICE  # noqa: E402
from test_padded_engine import EOS, run, tiny_llama  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """test_padded_engine's tiny Llama, on the tests' device."""
    return tiny_llama(tmp_path_factory).to(DEVICE)


# --- the bound ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,k,want",
    [
        ({}, 3, {1: 3, 50: 3}),
        ({"disable_by_batch_size": 3}, 4, {1: 4, 2: 4, 3: 0, 9: 0}),
        # gaps take the range before; past the last, the last; k above 2 is 2
        ({"num_speculative_tokens_per_batch_size": [[4, 6, 1], [1, 2, 3], [8, 8, 0]]}, 2,
         {1: 2, 2: 2, 3: 2, 4: 1, 6: 1, 7: 1, 8: 0, 100: 0}),
        ({"num_speculative_tokens_per_batch_size": [(1, 1, 4), (2, 9, 2)]}, 4,
         {1: 4, 2: 2, 40: 2}),
    ],
)  # fmt: skip
def test_the_bound_gives_each_running_count_its_drafts(
    raw: dict[str, Any], k: int, want: dict[int, int]
) -> None:
    bound = BatchBound.parse(raw)
    assert {n: bound.limit(n, k) for n in want} == want


@pytest.mark.parametrize(
    "raw,error",
    [
        ({"disable_by_batch_size": 1}, "at least 2"),
        ({"disable_by_batch_size": True}, "at least 2"),
        ({"disable_by_batch_size": "8"}, "at least 2"),
        ({"disable_by_batch_size": 4, "num_speculative_tokens_per_batch_size": [[1, 4, 2]]},
         "give one"),
        ({"num_speculative_tokens_per_batch_size": []}, "non-empty list"),
        ({"num_speculative_tokens_per_batch_size": {"1-16": 3}}, "non-empty list"),
        ({"num_speculative_tokens_per_batch_size": [[2, 8, 1]]}, "must start at 1"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, 2], [4, 8, 0]]}, "overlap at batch size 4"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, -1]]}, "k at least 0"),
        ({"num_speculative_tokens_per_batch_size": [[1, 0, 2]]}, "first <= last"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4]]}, "three integers"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, 2.0]]}, "three integers"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, 1, 4096, 2]]}, "five-item form"),
    ],
)  # fmt: skip
def test_the_bound_is_checked_as_vllm_checks_it(raw: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse({"method": "ngram", "num_speculative_tokens": 2, **raw})


# --- vLLM's other keys ------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
DRAFT = {"method": "draft_model", "model": "/m/small", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    "base,extra",
    [
        (NGRAM, {"enforce_eager": True, "disable_padded_drafter_batch": True,
                 "disable_eagle_block_drop": False, "use_local_argmax_reduction": True}),
        (DRAFT, {"draft_tensor_parallel_size": 1, "quantization": None, "kv_cache_dtype": "auto",
                 "attention_backend": "auto", "moe_backend": None,
                 "rejection_sample_method": "standard", "draft_sample_method": "greedy",
                 "use_heterogeneous_vocab": False, "parallel_drafting": False,
                 "enable_adaptive_verification": False, "enforce_eager": None}),
    ],
)  # fmt: skip
def test_keys_that_change_nothing_here_are_taken(
    base: dict[str, Any], extra: dict[str, Any]
) -> None:
    assert parse({**base, **extra}) == parse(base)


@pytest.mark.parametrize(
    "base,extra,error",
    [
        (DRAFT, {"draft_tensor_parallel_size": 2}, "only none or 1.*one device"),
        (DRAFT, {"draft_tensor_parallel_size": True}, "draft_tensor_parallel_size"),
        (NGRAM, {"tensor_parallel_size": 1}, "vLLM refuses it too"),
        (DRAFT, {"revision": "main"}, "revision is not served: .*local directory"),
        (DRAFT, {"code_revision": "v1"}, "no remote code"),
        (DRAFT, {"quantization": "fp8"}, "quantization kernels"),
        (DRAFT, {"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        (DRAFT, {"rejection_sample_method": "block"}, "only 'standard'"),
        (DRAFT, {"draft_sample_method": "probabilistic"}, "argmax"),
        (DRAFT, {"use_heterogeneous_vocab": True}, "vocabulary"),
        (DRAFT, {"parallel_drafting": True}, "parallel"),
        (NGRAM, {"disable_padded_drafter_batch": "yes"}, "disable_padded_drafter_batch"),
        (NGRAM, {"enforce_eager": 1}, "enforce_eager"),
        (NGRAM, {"suffix_decoding_max_tree_depth": 24}, "suffix decoding"),
        (NGRAM, {"synthetic_acceptance_length": 2.0}, "synthetic rejection sampling"),
        (NGRAM, {"target_model_config": {}}, "not a user setting"),
        (NGRAM, {"max_model_len": 64}, "ngram method has none"),
        (DRAFT, {"max_model_len": 0}, "positive integer"),
        (DRAFT, {"prompt_lookup_max": 3}, "unknown keys"),
        (NGRAM, {"model": "/m/small", "method": "ngram"}, "unknown keys"),
    ],
)  # fmt: skip
def test_keys_with_no_equivalent_are_refused_with_why(
    base: dict[str, Any], extra: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        parse({**base, **extra})


def test_the_settings_show_the_bound_and_the_draft_s_context() -> None:
    spec = parse({**NGRAM, "disable_by_batch_size": 6})
    assert isinstance(spec, NgramConfig) and spec.settings() == {
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
        "prompt_lookup_max": 5, "disable_by_batch_size": 6}  # fmt: skip
    draft = parse({**DRAFT, "max_model_len": 64,
                   "num_speculative_tokens_per_batch_size": [[1, 4, 2], [5, 64, 0]]})  # fmt: skip
    assert draft == DraftConfig("/m/small", 2, BatchBound(None, ((1, 4, 2), (5, 64, 0))), 64)


# --- the engine ---------------------------------------------------------------------------


class Recording:
    """A proposer that records, per step, the running count it was asked about and
    whether it was then asked for drafts (vLLM V0 skips the proposer too)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.steps: list[tuple[int, bool]] = []

    def limit(self, running: int) -> int:
        self.steps.append((running, False))
        return self.inner.limit(running)

    def propose(self, rows: Sequence[Row], budget: int) -> list[list[int]]:
        self.steps[-1] = (self.steps[-1][0], True)
        return self.inner.propose(rows, budget)

    def retain(self, sequences: Iterable[str]) -> None:
        self.inner.retain(sequences)

    def settings(self) -> dict[str, Any]:
        return self.inner.settings()


def _repeating(
    count: int, seed: int, new: tuple[int, int] = (12, 30), name: str = "s"
) -> list[tuple[str, list[int], int]]:
    """Prompts of a short phrase written over and over (its greedy text repeats too), so
    n-gram drafts are proposed, accepted and rejected."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        phrase = [rng.randrange(3, 300) for _ in range(rng.randint(2, 6))]
        out.append((f"{name}{i}", (phrase * 8)[: rng.randint(8, 30)], rng.randint(*new)))
    return out


def _engine(model: Any, spec: Any = None, **kw: Any) -> PaddedEngine:
    opts = {"eos_token_ids": [EOS], "step_tokens": 512, "max_running": 8, **kw}
    return PaddedEngine(model, speculative=spec, **opts)


def _lockstep(engine: PaddedEngine, seqs: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    """All added at once, end-of-sequence ignored: they prefill in one step and decode
    side by side until they end together."""
    for name, prompt, _ in seqs:
        engine.add(name, prompt, 24, Sampling(ignore_eos=True))
    done: dict[str, list[int]] = {}
    while len(done) < len(seqs):
        done.update((o.sequence, o.tokens) for o in engine.step() if o.finished)
    return done


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_a_bound_at_or_below_the_running_count_proposes_nothing(llama: Any, lean: bool) -> None:
    seqs = _repeating(4, seed=1)
    plain = _lockstep(_engine(llama, lean=lean), seqs)
    # Given four sequences decoding side by side, when the bound is 4 (vLLM: running >= 4)
    off = Recording(NgramConfig(3, 1, 3, BatchBound(disable_by_batch_size=4)))
    engine = _engine(llama, off, lean=lean)
    # Then no step proposes, every row is counted as skipped, and the tokens are the same
    assert _lockstep(engine, seqs) == plain
    assert engine.drafted == [0, 0] and not any(asked for _, asked in off.steps)
    # (in every decode step but the last, which takes each row's 24th token, all four
    # rows could have drafted)
    assert {n for n, _ in off.steps} == {4} and engine.spec_skipped == 4 * (len(off.steps) - 1)
    # When the bound is above the running count, drafts are proposed
    on = Recording(NgramConfig(3, 1, 3, BatchBound(disable_by_batch_size=5)))
    engine = _engine(llama, on, lean=lean)
    assert _lockstep(engine, seqs) == plain
    assert engine.drafted[1] > 0 and engine.spec_skipped == 0 and sum(engine.accepted) > 0


def test_a_range_of_k_0_turns_speculation_off_and_others_cap_the_drafts(llama: Any) -> None:
    seqs = _repeating(3, seed=2)
    plain = _lockstep(_engine(llama), seqs)
    table = ((1, 2, 3), (3, 8, 0))
    engine = _engine(llama, NgramConfig(3, 1, 3, BatchBound(None, table)))
    assert _lockstep(engine, seqs) == plain
    # (their 2nd to 23rd tokens: 22 steps in which each row could have drafted)
    assert engine.drafted == [0, 0] and engine.spec_skipped == 3 * 22
    table = ((1, 2, 3), (3, 8, 1))  # one draft a row
    engine = _engine(llama, NgramConfig(3, 1, 3, BatchBound(None, table)))
    assert _lockstep(engine, seqs) == plain
    assert engine.drafted[0] > 0 and engine.drafted[0] == engine.drafted[1]
    assert len(engine.accepted) == 1


def _arrivals() -> dict[int, list[tuple[str, list[int], int]]]:
    """Two long sequences, three short ones joining them a few steps later (two, then
    one), which end well before the long ones: 2 running, then 3 to 5, then 2 again."""
    short = _repeating(3, seed=4, new=(5, 8), name="short")
    return {0: _repeating(2, seed=3, new=(50, 60)), 6: short[:2], 8: short[2:]}


def _crossing(engine: PaddedEngine, spec: Recording, plain: dict[str, list[int]]) -> None:
    """With a bound of 3, every step with 3 or more running proposes nothing and every
    other one proposes; both kinds happen, and speculation comes back after steps
    without; drafts are accepted; the tokens are those without speculation."""
    assert run(engine, _arrivals()) == plain
    assert all(asked == (n < 3) for n, asked in spec.steps)
    switches = [b for a, b in zip(spec.steps, spec.steps[1:], strict=False) if a[1] != b[1]]
    assert [asked for _, asked in switches] == [False, True]  # off, then on again
    assert engine.spec_skipped > 0 and sum(engine.accepted) > 0


CROSSING = {"step_tokens": 24, "eos_token_ids": []}
"""Prefill in chunks; every sequence runs to its ``max_new_tokens``."""


@pytest.fixture(scope="module")
def plain_crossing(llama: Any) -> dict[str, list[int]]:
    return run(_engine(llama, **CROSSING), _arrivals())


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_crossing_the_bound_mid_run_switches_speculation(
    llama: Any, lean: bool, plain_crossing: dict[str, list[int]]
) -> None:
    spec = Recording(NgramConfig(3, 1, 3, BatchBound(disable_by_batch_size=3)))
    _crossing(_engine(llama, spec, lean=lean, **CROSSING), spec, plain_crossing)


def test_a_draft_model_lines_up_again_after_skipped_steps(
    llama: Any, plain_crossing: dict[str, list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    # Given: the target's own weights as the draft, so every draft it proposes is the
    # target's pick, and is accepted only where the draft's cache caught up with the
    # tokens the steps without speculation generated
    twin = AutoModelForCausalLM.from_pretrained(llama.name_or_path).eval().to(llama.device)
    proposer = DraftProposer(twin, DraftConfig("twin", 3, BatchBound(disable_by_batch_size=3)),
                             chunk=16)  # fmt: skip
    spec = Recording(proposer)
    engine = _engine(llama, spec, **CROSSING)
    _crossing(engine, spec, plain_crossing)
    assert sum(engine.accepted) == engine.drafted[1] and proposer.tokens == 0  # (all gone)


def _decoding(llama: Any, lean: bool, **kw: Any) -> tuple[PaddedEngine, Recording]:
    """An engine with one row decoding ("a", prefilled in the first of two steps), prefill
    chunks of at most about 20 tokens a step, and the running counts its steps ask about."""
    spec = Recording(NgramConfig(2))
    engine = _engine(llama, spec, lean=lean, step_tokens=24, **kw)
    engine.add("a", [5, 6, 7], 30, Sampling(ignore_eos=True))
    engine.step()
    engine.step()
    return engine, spec


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_the_running_count_is_the_sequences_the_step_before_ran(llama: Any, lean: bool) -> None:
    # Given: one row decoding, then two prompts that end with their first token, a
    # 40-token prompt (its prefill takes more than a step) and one in a later lane
    engine, spec = _decoding(llama, lean)
    engine.add("b", [8, 9], 1, Sampling())
    engine.add("c", [10, 11], 1, Sampling())
    engine.add("long", list(range(3, 43)), 5, Sampling())
    engine.add("queued", list(range(50, 60)), 5, Sampling(), priority=1)
    # When: a step begins the three lane-0 prefills ("queued" waits: "long" takes the
    # rest of the budget), and "b" and "c" end in it
    engine.step()
    assert [s.name for s in engine._rows] == ["a"] and engine._waiting["long"].done > 0
    assert engine._waiting["queued"].cache is None
    # Then: that step's row proposed by the count of the step before (vLLM's drafts then
    # were sized before these were scheduled), and the next step's by the four it ran
    # (vLLM V1's ``len(num_scheduled_tokens)``): "b" and "c" too, not "queued"
    assert engine.batch_size == 4
    engine.step()
    assert [n for n, _ in spec.steps[-2:]] == [1, 4]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("max_running,want", [(8, 4), (3, 3)])
def test_the_running_count_takes_the_n_completions_waiting_on_one_prefill(
    llama: Any, lean: bool, max_running: int, want: int
) -> None:
    # Given: one row decoding, then a request's 3 completions of a 40-token prompt: the
    # first prefills (in two steps), the others wait to take its prefill
    engine, spec = _decoding(llama, lean, max_running=max_running)
    for i in range(3):
        engine.add(f"n{i}", list(range(3, 43)), 5, Sampling())
    # When: a step runs the prompt's first chunk
    engine.step()
    assert engine._waiting["n0"].done > 0 and engine._waiting["n1"].cache is None
    # Then: the three count (vLLM schedules each completion as a request of its own), as
    # far as max_running lets them run; the next step's rows propose by that count
    assert engine.batch_size == want
    engine.step()
    assert spec.steps[-1][0] == want


# --- the runner and its counters --------------------------------------------------------


def test_the_runner_shows_the_bound_and_the_rows_that_skipped(tmp_path: Path) -> None:
    from batchfleet.schemas.messages import Request
    from batchfleet.worker.runner import Final, Work
    from batchfleet.worker.runners.generation import TextGenerationRunner

    options = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 8,
               "speculative": {**NGRAM, "disable_by_batch_size": 2,
                               "disable_padded_drafter_batch": True}}  # fmt: skip
    runner = TextGenerationRunner(make_causal_lm(tmp_path / "lm"), device=DEVICE,
                                  dtype="float32", options=options)  # fmt: skip
    reqs = [Request(id=f"r{i}", model="lm", inputs=["a b c a b c a b"],
                    max_new_tokens=40 if i == 2 else 8) for i in range(3)]  # fmt: skip
    admit = tuple((r.id, p) for r, p in zip(reqs, runner.prepare_many(reqs), strict=True))
    reports, finals = [], 0
    while finals < len(reqs):
        report = runner.step(Work(f"s{len(reports)}", admit))
        admit = ()
        report.settle()
        reports.append(report)
        finals += sum(isinstance(ev, Final) for ev in report.events)
    info = runner.info()
    assert info["speculative"]["disable_by_batch_size"] == 2
    skipped = sum(r.spec_skipped for r in reports)
    assert skipped > 0 and info["spec_decode_skipped_rows"] == skipped
    assert sum(r.drafted[0] for r in reports) > 0  # the long one, alone, speculates


def test_the_skipped_rows_counter_adds_up_the_steps() -> None:
    from batchfleet.worker.metrics import Metrics, PrometheusObserver
    from batchfleet.worker.observers import Generated
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    obs = PrometheusObserver(Metrics(registry))
    obs.notify(Generated("m", 9, 0, 100, 1000, 0, tokens=9, spec_skipped=9))
    obs.notify(Generated("m", 2, 0, 100, 1000, 0, tokens=4, drafted=(2, 6), accepted=(1,)))
    obs.notify(Generated("m", 4, 0, 100, 1000, 0, tokens=4, spec_skipped=4))
    got = registry.get_sample_value("batchfleet_spec_decode_num_skipped_rows_total", {"model": "m"})
    assert got == 13


def test_the_worker_s_stats_count_the_rows_that_skipped() -> None:
    from batchfleet.worker.observers import Generated
    from batchfleet.worker.stats import LoopStats

    stats = LoopStats("m", 3)
    stats.notify(Generated("m", 3, 0, 100, 1000, 0, tokens=3))
    assert "spec_skipped_rows" not in stats.snapshot()["generation"]
    stats.notify(Generated("m", 9, 0, 100, 1000, 0, tokens=9, spec_skipped=9))
    assert stats.snapshot()["generation"]["spec_skipped_rows"] == 9
    stats.notify(Generated("m", 2, 0, 100, 1000, 0, tokens=4, drafted=(2, 6), accepted=(1,)))
    gen = stats.snapshot()["generation"]
    assert (gen["spec_skipped_rows"], gen["spec_draft_tokens"]) == (9, 6)


def test_a_draft_s_max_model_len_ends_its_drafts_and_is_checked_at_load(llama: Any) -> None:
    from batchfleet.worker.generation.draft import load, positions

    path = llama.name_or_path
    context = list(range(3, 23))  # 20 tokens
    for most, want in ((30, 3), (21, 2), (19, 0)):  # no draft past max_model_len
        proposer = load(DraftConfig(path, 3, max_model_len=most), llama, 16, max_context=64)
        assert proposer.settings()["max_model_len"] == most
        for _ in range(3):  # (its prompt goes into the draft's cache 16 tokens a call)
            if drafts := proposer.propose([("a", context, 3)], 8)[0]:
                break
        assert len(drafts) == want
    with pytest.raises(ValueError, match="exceeds the model's context"):
        load(DraftConfig(path, 3, max_model_len=65), llama, 16, max_context=64)
    over = positions(llama) + 1
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load(DraftConfig(path, 3, max_model_len=over), llama, 16, max_context=None)
