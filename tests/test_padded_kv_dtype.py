"""``kv_cache_dtype`` bfloat16 in the padded engine: keys and values rounded wherever they
are written and read widened, so a sequence's greedy tokens are the same whatever else
runs beside it, however its prefill is chunked, whether its prefix came from the prefix
cache, a twin's prefill or a recompute after preemption, with speculative drafts or
without; its log-probabilities stay close to a float32 cache's; the runner reads the
option (vLLM's ``--kv-cache-dtype``), refuses a value it has not and the paged engine,
and shows it in its model info."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchfleet.worker.generation.padded import PaddedEngine  # noqa: E402
from batchfleet.worker.generation.prefix_cache import PrefixCache  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling  # noqa: E402
from batchfleet.worker.generation.speculative import NgramConfig  # noqa: E402
from test_padded_engine import EOS, preempted, run, tiny_llama  # noqa: E402
from test_speculative import _repetitive  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

BF16 = torch.bfloat16
LOGPROB_TOLERANCE = 0.02
"""How far a token's log-probability may move when keys and values are rounded to
bfloat16 (8 significant bits: about 0.4% each) on the tiny sharp-attention Llama; its
largest move here is about 0.003."""
SAME = 1e-4
"""How far the same sequence's log-probabilities may differ between two runs over the
same rounded keys (float32 sums in another order: another batch, chunk or kernel); a
rounding that depended on the run would move them by about as much as bfloat16 does."""
Runs = dict[str, tuple[list[int], list[float]]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_llama(tmp_path_factory)


def _engine(model: Any, kv: torch.dtype | None = BF16, **kw: Any) -> PaddedEngine:
    kw = {"step_tokens": 48, "max_running": 6, **kw}
    return PaddedEngine(model, eos_token_ids=[EOS], kv_cache_dtype=kv, **kw)


def _seqs(model: Any, count: int, seed: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    return [(f"s{i}", [rng.randrange(3, vocab) for _ in range(rng.randint(1, 70))],
             rng.randint(1, 30)) for i in range(count)]  # fmt: skip


def _run(engine: PaddedEngine, arrivals: dict[int, list[tuple[str, list[int], int]]]) -> Runs:
    """Step until every sequence finished, adding ``arrivals[step]`` before each step:
    each one's tokens and their log-probabilities."""
    names = [name for at in arrivals.values() for name, _, _ in at]
    done: dict[str, list[int]] = {}
    step = 0
    while len(done) < len(names):
        for name, prompt, n in arrivals.get(step, []):
            engine.add(name, prompt, n, Sampling(logprobs=0))
        done.update((o.sequence, o.tokens) for o in engine.step() if o.finished)
        step += 1
        assert step < 2000
    return {n: (done[n], [lp for _, lp, *_ in engine.logprobs(n)]) for n in names}


def _alone(engine: PaddedEngine, seqs: list[tuple[str, list[int], int]]) -> Runs:
    """Each sequence run by itself through ``engine``, one after another."""
    out: Runs = {}
    for s in seqs:
        out.update(_run(engine, {0: [s]}))
    return out


def _same(got: Runs, want: Runs) -> None:
    """The same tokens, and log-probabilities within :data:`SAME`."""
    assert got.keys() == want.keys()
    for name, (tokens, lps) in want.items():
        assert got[name][0] == tokens, name
        assert got[name][1] == pytest.approx(lps, abs=SAME, rel=0), name


@pytest.mark.parametrize(
    "row_attention,lean,max_context",
    [(True, True, None), (True, False, None), (False, True, None), (False, False, None),
     (True, True, 128)],
    ids=["row-attention", "row-attention-transformers", "sdpa", "sdpa-transformers",
         "row-attention-reserved"],
)  # fmt: skip
def test_greedy_tokens_do_not_depend_on_what_else_runs(
    llama: Any, row_attention: bool, lean: bool, max_context: int | None
) -> None:
    # Given sequences arriving at different steps (prefills chunked beside running rows,
    # rows joining and leaving), two with the same prompt (a shared prefill)
    rng = random.Random(7)
    seqs = _seqs(llama, 12, seed=7)
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    twin = ("twin", list(seqs[3][1]), seqs[3][2])
    for i, s in enumerate(seqs):
        at = arrivals.setdefault(rng.choice([0, 0, 1, 3, 5, 9, 20]) + i // 5, [])
        at += [s, twin] if i == 3 else [s]
    seqs.append(twin)
    engine = _engine(llama, row_attention=row_attention, lean=lean, max_context=max_context)
    assert engine.row_attention is row_attention and (engine.lean is not None) is lean
    # When they run together, and each alone through an engine like it
    got = _run(engine, arrivals)
    assert engine._layers[0]._k is not None and engine._layers[0]._k.dtype == BF16
    alone = _alone(_engine(llama, row_attention=row_attention, lean=lean), seqs)
    # Then each gets the tokens it gets alone, with their log-probabilities
    _same(got, alone)
    assert got["twin"][0] == got["s3"][0]


def test_a_bfloat16_cache_is_half_the_bytes_and_logprobs_stay_close(llama: Any) -> None:
    seqs = _seqs(llama, 6, seed=11)

    def logprobs(kv: torch.dtype | None) -> tuple[PaddedEngine, dict[str, list[float]]]:
        engine = _engine(llama, kv, step_tokens=24)
        for name, prompt, n in seqs:
            engine.add(name, prompt, n, Sampling(logprobs=0))
            engine.add(name + "p", prompt, 0, Sampling(), score=0)  # chunked prefill's
        done: set[str] = set()
        while len(done) < 2 * len(seqs):
            done.update(o.sequence for o in engine.step() if o.finished)
        out = {n: [lp for _, lp, *_ in engine.logprobs(n)] for n, _, _ in seqs}
        out.update({n + "p": [lp for _, lp, *_ in engine.prompt_logprobs(n + "p")]
                    for n, _, _ in seqs})  # fmt: skip
        return engine, out

    full, want = logprobs(None)
    half, got = logprobs(BF16)
    (k32, k16) = (e._layers[0]._k for e in (full, half))
    assert k32 is not None and k16 is not None and k16.shape == k32.shape
    assert k16.dtype == BF16 and k16.nbytes * 2 == k32.nbytes
    for name, lps in want.items():
        # the generated tokens' (the same tokens: greedy, a margin above the rounding)
        assert got[name] == pytest.approx(lps, abs=LOGPROB_TOLERANCE), name
    worst = max(abs(a - b) for n in want for a, b in zip(want[n], got[n], strict=True))
    # bfloat16 indeed, its rounding far above SAME (about 0.003 here): the tests that
    # compare runs within SAME would see a rounding that depended on the run
    assert worst > 10 * SAME


def test_a_prefix_from_the_cache_gives_the_tokens_of_its_own_prefill(llama: Any) -> None:
    # blocks hold what the prefill's slab held (bfloat16): a prompt taking them gives the
    # tokens it gives prefilling them itself
    rng = random.Random(3)
    system = [rng.randrange(3, 300) for _ in range(70)]
    seqs = [(f"q{i}", [*system, *(rng.randrange(3, 300) for _ in range(rng.randint(1, 20)))], 10)
            for i in range(4)]  # fmt: skip
    cache = PrefixCache(capacity=512, block=16)
    engine = _engine(llama, step_tokens=40, max_running=8, prefix_cache=cache)
    got = _alone(engine, seqs)
    assert cache.hit_tokens == 3 * 64
    _same(got, _alone(_engine(llama, step_tokens=40, max_running=8), seqs))


def test_a_preempted_sequence_resumes_to_its_own_tokens(llama: Any) -> None:
    # recomputed from its prompt and what it generated: those tokens' keys and values are
    # prefilled now, decoded before, and read the same (rounded both times)
    prompt = [9, 8, 7, 6, 11, 40, 3, 100, 21, 5]
    want = _run(_engine(llama), {0: [("r", prompt, 24)]})["r"]
    engine = _engine(llama)
    tokens = preempted(engine, prompt, 24, 8)
    assert len(tokens) == 8
    more = _run(engine, {0: [("r", prompt + tokens, 24 - len(tokens))]})["r"]
    assert tokens + more[0] == want[0]
    assert more[1] == pytest.approx(want[1][8:], abs=SAME, rel=0)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_speculative_drafts_verified_over_a_bfloat16_row_give_its_tokens(
    llama: Any, lean: bool
) -> None:
    seqs = _repetitive(llama, 10, seed=4)
    arrivals = {3 * i: [s] for i, s in enumerate(seqs)}
    plain = run(_engine(llama, step_tokens=40, max_running=5, lean=lean), arrivals)
    spec = _engine(llama, step_tokens=40, max_running=5, lean=lean,
                   speculative=NgramConfig(4, 1, 3))  # fmt: skip
    assert run(spec, arrivals) == plain
    assert sum(spec.accepted) > 0


def test_the_model_s_own_dtype_is_no_change(llama: Any) -> None:
    engine = _engine(llama, torch.float32)
    assert engine.kv_dtype is None


# --- the runner's option ---------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


def _runner(lm_dir: Path, **opts: Any) -> Any:
    from batchfleet.worker.runners.generation import TextGenerationRunner

    opts = {"kv_cache_tokens": 2048, "page_size": 4, "step_tokens": 64, "max_running": 16,
            **opts}  # fmt: skip
    return TextGenerationRunner(lm_dir, device="cpu", dtype="float32", options=opts)


def test_the_runner_takes_the_option_and_shows_it(lm_dir: Path) -> None:
    from test_generation_runner import req
    from test_generation_runner import run as run_requests

    runner = _runner(lm_dir, kv_cache_dtype="bfloat16")
    assert runner.info()["kv_cache_dtype"] == "bfloat16"
    assert runner.engine.kv_dtype == BF16
    assert _runner(lm_dir).info()["kv_cache_dtype"] == "float32"
    # a beam search (rounds taking their prompt's blocks from the prefix cache) beside
    # plain requests gives the beams it gives alone
    beam = dict(use_beam_search=True, n=2, max_new_tokens=6, return_token_ids=True)
    want = run_requests(runner, req("w", **beam))["w"]
    out = run_requests(runner, req("g1", max_new_tokens=9), req("b", **beam),
                       req("g2", inputs=["there were many years"], max_new_tokens=9))  # fmt: skip
    assert [o["token_ids"] for o in out["b"]] == [o["token_ids"] for o in want]
    assert runner.engine.prefix is not None and runner.engine.prefix.hit_tokens > 0


@pytest.mark.parametrize(
    "opts,error",
    [({"kv_cache_dtype": "fp8"}, "options.kv_cache_dtype: 'fp8' is not one of 'auto', "),
     ({"kv_cache_dtype": None}, "options.kv_cache_dtype: None is not one of"),
     ({"kv_cache_dtype": "bfloat16", "engine": "paged"},
      "options.kv_cache_dtype: 'bfloat16' needs the padded engine")],
    ids=["fp8", "none", "paged"],
)  # fmt: skip
def test_a_value_it_cannot_take_is_a_startup_error(
    lm_dir: Path, opts: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        _runner(lm_dir, **opts)
