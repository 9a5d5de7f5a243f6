"""Prefix caching on the paged engine (:mod:`batchfleet.worker.generation.paged_prefix`):
a prompt beginning as an earlier one did takes its full blocks (``cached``) and its greedy
tokens equal those without sharing and HF ``generate``'s; salts and adapters partition the
blocks; a scored prompt takes none; ``n`` twins prefill once; blocks go back to the pool
when their last user leaves (and are evicted when a sequence needs the room); a model with
a sliding-window layer shares nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE
from tiny_models import make_causal_lm

torch = pytest.importorskip("torch")

from batchfleet.worker.generation.engine import SeqState  # noqa: E402
from batchfleet.worker.generation.paged import PagedEngine  # noqa: E402
from batchfleet.worker.generation.paged_prefix import seed  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling  # noqa: E402

PAGE = 8
SYSTEM = [(37 * i + 11) % 380 + 10 for i in range(35)]
"""A shared 35-token "system prompt": four full blocks, and three tokens of a fifth."""
GREEDY = Sampling(logprobs=0)
"""Greedy, each token's log-probability kept: the tiny model's greedy text repeats a
token, so the log-probabilities are what shows keys and values read from a wrong place."""


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm") / "lm")


@pytest.fixture(scope="module")
def model(lm: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).eval().to(DEVICE)


@pytest.fixture(scope="module")
def adapters(lm: Path, model: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    """Two LoRA adapters of the model (peft's layout), loaded."""
    pytest.importorskip("peft")
    from batchfleet.worker.generation.lora import load
    from test_generation_lora import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    return tuple(load(n, make_adapter(root / n, lm, seed=s), model, 64)
                 for n, s in (("sql", 1), ("chat", 2)))  # fmt: skip


def _engine(model: Any, *, blocks: int = 64, sharing: bool = True, **kw: Any) -> PagedEngine:
    return PagedEngine(model, eos_token_ids=[], pad_token_id=0, kv_blocks=blocks,
                       page_size=PAGE, step_tokens=kw.pop("step_tokens", 64), max_running=8,
                       prefix_sharing=sharing, **kw)  # fmt: skip


def _run(engine: PagedEngine, todo: dict[str, list[int]], new: int = 6,
         **kw: Any) -> dict[str, list[int]]:  # fmt: skip
    for name, tokens in todo.items():
        engine.add(name, tokens, new, GREEDY, **kw)
    return _drain(engine, list(todo))


def _drain(engine: PagedEngine, names: list[str]) -> dict[str, list[int]]:
    """Step until these sequences ended; their tokens."""
    out: dict[str, list[int]] = {}
    for _ in range(200):
        for o in engine.step():
            out[o.sequence] = o.tokens
        if all(engine.state(n) is None for n in names):
            return out
    raise AssertionError("the engine did not finish")


def _hf(model: Any, tokens: list[int], new: int = 6) -> list[int]:
    ids = torch.tensor([tokens], device=model.device)
    out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         eos_token_id=model.config.vocab_size)  # fmt: skip
    return [int(t) for t in out[0, len(tokens) :]]


def _logprobs(engine: PagedEngine, name: str) -> list[float]:
    return [lp[1] for lp in engine.logprobs(name)]


def _alone(model: Any, name: str, tokens: list[int], new: int = 6) -> list[float]:
    """A sequence's tokens' log-probabilities where nothing is shared."""
    plain = _engine(model, sharing=False)
    _run(plain, {name: tokens}, new)
    assert plain.cached(name) == 0
    return _logprobs(plain, name)


def _free(engine: PagedEngine) -> tuple[int, int]:
    """The full-attention group's blocks: (free in the pool or a free sector, cached)."""
    cache = engine.processor.cache
    a = cache.cache_allocators["full_attention"]
    free = cache.pool.count_free_blocks(a.index) + cache.pool.num_free_sectors * a.blocks_per_sector
    return free, len(a.ledger.cached_blocks)


def test_a_repeated_prefix_is_taken_from_the_cache_and_changes_no_token(model: Any) -> None:
    # Given two prompts that begin with the same system prompt, one after the other
    a, b = [*SYSTEM, 5, 6, 7], [*SYSTEM, 9, 10, 11, 12]
    engine = _engine(model)
    first = _run(engine, {"a": a})
    # When the second runs
    second = _run(engine, {"b": b})
    # Then it took the four full blocks they share, and its tokens are those of HF's generate
    assert engine.cached("a") == 0 and engine.cached("b") == 4 * PAGE
    assert engine.sharing.hit_tokens == 4 * PAGE
    assert first["a"] == _hf(model, a) and second["b"] == _hf(model, b)
    assert _logprobs(engine, "b") == pytest.approx(_alone(model, "b", b), abs=1e-5)


def test_a_whole_prompt_seen_before_leaves_its_last_token_to_prefill(model: Any) -> None:
    engine = _engine(model)
    prompt = SYSTEM[:32]  # exactly four blocks
    _run(engine, {"a": prompt})
    again = _run(engine, {"b": prompt})
    assert engine.cached("b") == 3 * PAGE  # the fourth holds the token whose logits it needs
    assert again["b"] == _hf(model, prompt)
    assert _logprobs(engine, "b") == pytest.approx(_alone(model, "b", prompt), abs=1e-5)


@pytest.mark.parametrize(
    ("first", "second"),
    [({"salt": "tenant-1"}, {"salt": "tenant-2"}), ({}, {"salt": "tenant-1"}),
     ({"salt": "t"}, {"salt": "t", "lora": 1}), ({"lora": 1}, {"lora": 2}), ({}, {"lora": 1})],
)  # fmt: skip
def test_salts_and_adapters_partition_the_blocks(
    model: Any, adapters: tuple[Any, ...], first: dict[str, Any], second: dict[str, Any]
) -> None:
    engine = _engine(model, adapters=adapters)
    a, b = [*SYSTEM, 5], [*SYSTEM, 6]
    _run(engine, {"a": a}, **first)
    _run(engine, {"b": b}, **second)
    assert engine.cached("b") == 0
    _run(engine, {"c": [*SYSTEM, 7]}, **second)  # the same salt and adapter share
    assert engine.cached("c") == 4 * PAGE


def test_the_same_prompt_under_another_salt_is_no_twin_and_does_not_wait(model: Any) -> None:
    engine = _engine(model, step_tokens=128)
    prompt = [*SYSTEM, 5]
    engine.add("a", prompt, 3, GREEDY, salt="tenant-1")
    engine.add("b", prompt, 3, GREEDY, salt="tenant-2")
    engine.step()  # both prefill in the first step
    assert [engine.state(n) for n in "ab"] == [SeqState(len(prompt) + 1, prefill_left=0)] * 2
    _drain(engine, ["a", "b"])
    assert engine.cached("b") == 0


def test_an_adapter_put_at_a_label_anew_finds_none_of_the_formers_blocks(
    model: Any, adapters: tuple[Any, ...]
) -> None:
    engine = _engine(model, adapters=adapters)
    _run(engine, {"a": [*SYSTEM, 5]}, lora=1)
    engine.set_adapter(1, adapters[1])
    _run(engine, {"b": [*SYSTEM, 6]}, lora=1)
    assert engine.cached("b") == 0


def test_the_salt_starts_the_chain(model: Any) -> None:
    assert seed(None) is None
    assert seed("x") != seed("y") and seed("x") == seed("x")
    assert seed(("x", 1, 0)) != seed(("x", 1, 1)) != seed(("x", 2, 1))


def test_a_scored_prompt_takes_no_block_and_scores_every_position(model: Any) -> None:
    engine = _engine(model)
    prompt = [*SYSTEM, 5, 6]
    _run(engine, {"a": prompt})
    _run(engine, {"b": prompt}, score=1)
    assert engine.cached("b") == 0
    kept = engine.prompt_logprobs("b")
    assert len(kept) == len(prompt) - 1
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device=model.device)).logits[0].log_softmax(-1)
    for i, lp in enumerate(kept):
        assert lp[0] == prompt[i + 1]
        assert lp[1] == pytest.approx(float(logits[i, prompt[i + 1]]), abs=1e-4)


@pytest.mark.parametrize("step", [16, 128])
def test_n_twins_prefill_once_and_draw_their_own_tokens(model: Any, step: int) -> None:
    # Given a request's three completions, sampled, added together; a budget of 16 tokens a
    # step (the prompt prefills in chunks) or of 128 (all three would fit in the first)
    engine = _engine(model, step_tokens=step)
    prompt = [*SYSTEM, 5, 6]
    draws = [Sampling(temperature=1.0, seed=s, logprobs=0) for s in (1, 2, 3)]
    for i, s in enumerate(draws):
        engine.add(f"n{i}", prompt, 5, s)
    # While the first prefills, the others wait (None: added, the engine takes them next)
    engine.step()
    for twin in ("n1", "n2"):
        state = engine.state(twin)
        assert state is None or (state.context, state.prefill_left) == (0, len(prompt))
    out: dict[str, list[int]] = {}
    for _ in range(50):
        for o in engine.step():
            out[o.sequence] = o.tokens
    # Then the others took its four full blocks, and each drew its own tokens, as alone
    assert [engine.cached(f"n{i}") for i in range(3)] == [0, 4 * PAGE, 4 * PAGE]
    for i, s in enumerate(draws):
        alone = _engine(model, sharing=False)
        alone.add("x", prompt, 5, s)
        solo: list[int] = []
        for _ in range(50):
            for o in alone.step():
                solo = o.tokens
        assert out[f"n{i}"] == solo
        assert _logprobs(engine, f"n{i}") == pytest.approx(_logprobs(alone, "x"), abs=1e-5)


def test_a_twin_cancelled_while_waiting_never_runs_and_its_leaders_cancel_frees_them(
    model: Any,
) -> None:
    engine = _engine(model, step_tokens=16)
    prompt = [*SYSTEM, 5]
    for name in ("a", "b", "c"):
        engine.add(name, prompt, 3, GREEDY)
    engine.cancel(["b"])
    assert engine.state("b") is None
    engine.step()
    engine.cancel(["a"])  # before its prefill is done: c runs on its own
    out: dict[str, list[int]] = {}
    for _ in range(50):
        for o in engine.step():
            out[o.sequence] = o.tokens
    assert set(out) == {"c"} and out["c"] == _hf(model, prompt, 3)


def test_shared_blocks_outlive_a_preempted_user_and_go_back_when_the_last_leaves(
    model: Any,
) -> None:
    # Given two sequences that share four blocks, both running
    engine = _engine(model, blocks=32)
    total = _free(engine)[0]
    a, b = [*SYSTEM, 5], [*SYSTEM, 6]
    _run(engine, {"a": a}, new=1)
    engine.add("b", b, 8, GREEDY)
    engine.add("c", [*SYSTEM, 7], 8, GREEDY)
    out: dict[str, list[int]] = {}
    for _ in range(3):
        for o in engine.step():
            out[o.sequence] = o.tokens
    assert engine.cached("b") == engine.cached("c") == 4 * PAGE
    # When one is preempted (cancelled, added again with what it generated) and both end
    engine.cancel(["b"])
    engine.step()  # (the runner adds a preempted sequence again in a later step)
    resumed = b + out.pop("b")
    engine.add("b", resumed, 8 - len(resumed) + len(b), GREEDY)
    for _ in range(50):
        for o in engine.step():
            out[o.sequence] = o.tokens
    # Then the tokens are HF's, and every block is free or cached (none held)
    assert resumed[len(b) :] + out["b"] == _hf(model, b, 8)
    assert out["c"] == _hf(model, [*SYSTEM, 7], 8)
    assert _logprobs(engine, "c") == pytest.approx(_alone(model, "c", [*SYSTEM, 7], 8), abs=1e-5)
    assert _logprobs(engine, "b") == pytest.approx(_alone(model, "b", b, 8), abs=1e-5)
    free, cached = _free(engine)
    assert cached > 0 and free + cached == total
    assert engine.processor.cache.evict_cached_blocks() and _free(engine) == (total, 0)


def test_a_preempted_sequence_taking_its_own_blocks_back_reports_none_cached(
    model: Any,
) -> None:
    engine = _engine(model)
    prompt = SYSTEM[:20]
    engine.add("x", prompt, 8, GREEDY)
    got: list[int] = []
    for _ in range(3):
        for o in engine.step():
            got = o.tokens
    engine.cancel(["x"])
    engine.step()
    engine.add("x", prompt + got, 8 - len(got), GREEDY)
    engine.step()
    assert engine.sharing.hit_tokens == 2 * PAGE  # its own two blocks came back
    assert engine.cached("x") == 0


def test_cached_blocks_give_way_when_a_sequence_needs_their_room(model: Any) -> None:
    # Given a cache of 20 blocks, 8 of them cached by an earlier prompt, and a sequence
    # decoding in 1 more (half the cache free: over transformers' safety margin)
    engine = _engine(model, blocks=20, step_tokens=128)
    _run(engine, {"a": list(range(100, 164))}, new=1)
    engine.add("d", list(range(300, 308)), 30, GREEDY)
    engine.step()
    assert _free(engine) == (11, 8)
    # When a prompt needing 12 blocks comes, it begins at once (the cached blocks go)
    other = list(range(200, 290))
    engine.add("b", other, 4, GREEDY)
    engine.step()
    state = engine.state("b")
    assert state is not None and state.prefill_left == 0
    assert _drain(engine, ["b"])["b"] == _hf(model, other, 4)


def test_forgotten_blocks_are_found_no_more_and_go_back_when_their_user_leaves(
    model: Any,
) -> None:
    engine = _engine(model)
    total = _free(engine)[0]
    _run(engine, {"a": [*SYSTEM, 5]}, new=1)
    engine.add("b", [*SYSTEM, 6], 4, GREEDY)
    engine.step()
    assert engine.cached("b") == 4 * PAGE
    assert engine.forget_blocks() == 4  # the four shared, b's holds them
    _drain(engine, ["b"])
    _run(engine, {"c": [*SYSTEM, 7]}, new=1)
    assert engine.cached("c") == 0 and _free(engine)[0] + _free(engine)[1] == total
    engine.forget_blocks()
    assert _free(engine) == (total, 0)  # b's blocks were freed, not cached, when it left


def test_the_runner_reports_cached_tokens_and_resets_the_shared_blocks(lm: Path) -> None:
    from batchfleet.schemas.messages import Request
    from batchfleet.worker.runners.generation import TextGenerationRunner
    from test_generation_runner import run

    runner = TextGenerationRunner(lm, device=DEVICE, dtype="float32",
                                  options={"engine": "paged", "page_size": 16})  # fmt: skip
    words = " ".join(f"w{i}" for i in range(40))

    def cached(rid: str, n: int = 1) -> list[int]:
        request = Request(id=rid, model="lm", inputs=[words], max_new_tokens=2, n=n)
        return [int(o["cached_tokens"]) for o in run(runner, request)[rid]]

    # Given a prompt run twice: the second time its whole blocks are taken
    assert cached("a") == [0]
    (hit,) = cached("b")
    assert hit > 0 and hit % 16 == 0 and runner.info()["prefix_cache_hit_tokens"] == hit
    # When the shared blocks are reset, the prompt is prefilled whole again, once for n 3
    assert runner.reset_prefix_cache() is True
    assert cached("c", n=3) == [0, hit, hit]


def test_a_sliding_window_model_shares_nothing(tmp_path: Path) -> None:
    from test_generation_lora import make_other
    from transformers import AutoModelForCausalLM

    lm = make_causal_lm(tmp_path / "lm")
    path = make_other(tmp_path / "m", lm, "mistral", sliding_window=8)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(DEVICE)
    engine = _engine(model)
    assert not engine.sharing.on
    a = [*SYSTEM, 5]
    first = _run(engine, {"a": a, "b": a})  # no twin held either
    assert engine.cached("b") == 0 and first["a"] == first["b"] == _hf(model, a)
