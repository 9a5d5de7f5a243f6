"""Prefix caching: the block store on its own (longest held prefix, one token always left
to prefill, a hash collision never lends keys, eviction within its capacity takes a
prompt's tail before its head, a salt's blocks found only with that salt), and the
padded engine with it (salted prompts share neither blocks nor a prefill): prompts sharing a system
prompt prefill only what follows it and still give ``generate``'s greedy tokens (through
the lean step forward and through transformers' own), a sampled request draws what it
draws without the cache, and a preempted sequence resumes from its own blocks; the
runner's option."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchfleet.worker.generation.engine import SeqState  # noqa: E402
from batchfleet.worker.generation.padded import PaddedEngine  # noqa: E402
from batchfleet.worker.generation.prefix_cache import PrefixCache, _Block  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling  # noqa: E402
from devices import DEVICE  # noqa: E402
from test_padded_engine import EOS, _until_done, generate, preempted  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tests' tiny Llama, whose attention is sharp (``make_causal_lm``): wrong keys
    show."""
    from transformers import AutoModelForCausalLM

    return (
        AutoModelForCausalLM.from_pretrained(make_causal_lm(tmp_path_factory.mktemp("lm")))
        .eval()
        .to(DEVICE)
    )


def kv_of(tokens: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fake cache whose every column holds its token id (keys) and minus it (values)."""
    t = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(1, 2, -1, 3)
    return [(t.clone() + i, -t.clone() - i) for i in range(layers)]


def columns(kv: Any) -> list[int]:
    """The token ids the found prefix's layer-0 keys hold, in order."""
    return [int(x) for x in kv[0][0, 0, 0, :, 0]]


def test_a_lookup_finds_the_longest_held_prefix_and_leaves_a_token_to_prefill() -> None:
    cache = PrefixCache(capacity=64, block=4)
    system = list(range(10, 22))  # 12 tokens: 3 blocks
    assert cache.store([*system, 1, 2], kv_of([*system, 1, 2])) == 3  # the partial block stays out
    assert cache.tokens == 12
    n, blocks = cache.lookup([*system, 7, 8, 9])
    assert n == 12 and columns(blocks) == system
    assert blocks[1][1, 0, 0, 4:8, 0].tolist() == [-15.0, -16.0, -17.0, -18.0]  # layer 1 values
    n, _ = cache.lookup(system)  # all held, but one token must be left to prefill
    assert n == 8
    n, blocks = cache.lookup([*system[:6], 99, *system[7:], 5])  # differs in block 2
    assert n == 4 and columns(blocks) == system[:4]
    assert cache.lookup([99, *system])[0] == 0
    assert cache.hit_tokens == 12 + 8 + 4
    assert cache.store([*system, 1, 2], kv_of([*system, 1, 2])) == 0  # held already


def test_a_hash_collision_never_lends_another_prompt_s_keys() -> None:
    cache = PrefixCache(capacity=64, block=4)
    cache.store([1, 2, 3, 4, 5], kv_of([1, 2, 3, 4, 5]))
    ((h, block),) = cache._blocks.items()
    cache._blocks[h] = _Block((9, 9, 9, 9), None, block.kv)  # as if another prompt hashed the same
    assert cache.lookup([1, 2, 3, 4, 5]) == (0, None)


def test_a_salted_prompt_finds_only_blocks_of_its_own_salt() -> None:
    # vLLM's cache_salt: a tenant cannot time whether another's prompt began as its own
    cache = PrefixCache(capacity=64, block=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert cache.store(prompt, kv_of(prompt), salt="tenant-a") == 2
    assert cache.lookup(prompt) == (0, None) and cache.peek(prompt, "tenant-b") == 0
    assert cache.lookup(prompt, "tenant-b") == (0, None)
    n, blocks = cache.lookup(prompt, "tenant-a")
    assert n == 8 and columns(blocks) == prompt[:8]
    assert cache.store(prompt, kv_of(prompt)) == 2  # unsalted: blocks of their own
    assert cache.store(prompt, kv_of(prompt), salt="tenant-b") == 2 and cache.tokens == 24
    # a block held under another salt, even at the same hash, is not lent
    (h,) = cache._hashes(prompt, 1, "tenant-a")
    block = cache._blocks[h]
    cache._blocks[h] = _Block(block.tokens, "tenant-x", block.kv)
    assert cache.lookup(prompt, "tenant-a")[0] == 0


def test_eviction_keeps_within_capacity_and_takes_tails_before_heads() -> None:
    cache = PrefixCache(capacity=16, block=4)  # 4 blocks
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    cache.store([*system, 10, 11, 12, 13, 0], kv_of([*system, 10, 11, 12, 13, 0]))  # 3 blocks
    cache.store([*system, 20, 21, 22, 23, 0], kv_of([*system, 20, 21, 22, 23, 0]))  # 1 new
    assert cache.tokens == 16
    cache.store([*system, 30, 31, 32, 33, 0], kv_of([*system, 30, 31, 32, 33, 0]))
    # the oldest tail went (10..13); the shared head, touched by every store, stays
    assert cache.tokens == 16
    assert cache.lookup([*system, 10, 11, 12, 13, 0])[0] == 8
    assert cache.lookup([*system, 20, 21, 22, 23, 0])[0] == 12
    assert cache.lookup([*system, 30, 31, 32, 33, 0])[0] == 12
    long = list(range(40, 80))  # 10 blocks: only the first 4 fit, and they push out the rest
    cache.store([*long, 0], kv_of([*long, 0]))
    assert cache.tokens == 16 and cache.lookup([*long, 0])[0] == 16
    assert cache.lookup([*system, 30, 31, 32, 33, 0])[0] == 0
    assert PrefixCache(capacity=3, block=4).store([1, 2, 3, 4, 5], kv_of([1, 2, 3, 4, 5])) == 0
    mixed = [*kv_of([1, 2, 3, 4, 5], 1), (torch.zeros(1, 1, 5, 3), torch.zeros(1, 1, 5, 3))]
    assert PrefixCache(capacity=16, block=4).store([1, 2, 3, 4, 5], mixed) == 0  # not cached


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_prompts_sharing_a_system_prompt_prefill_only_the_rest(llama: Any, fused: bool) -> None:
    # Given a 70-token system prompt, then requests that add their own question to it:
    # one first, the others arriving together once it has run (some mid-prefill of
    # each other), beside a request with no shared prefix
    rng = random.Random(3)
    system = [rng.randrange(3, 300) for _ in range(70)]
    questions = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    prompts = {f"q{i}": [*system, *q] for i, q in enumerate(questions)}
    prompts["other"] = [rng.randrange(3, 300) for _ in range(30)]
    cache = PrefixCache(capacity=512, block=16)
    engine = PaddedEngine(llama, eos_token_ids=[EOS], step_tokens=40, max_running=8,
                          lean=fused, prefix_cache=cache)  # fmt: skip
    engine.add("q0", prompts["q0"], 8, Sampling())
    got = _until_done(engine)
    assert engine.prefilled == len(prompts["q0"]) and cache.tokens >= 64
    for name, prompt in prompts.items():
        if name != "q0":  # log-probabilities kept: they show a wrong key at once
            engine.add(name, prompt, 8, Sampling(logprobs=0))
    got.update(_until_done(engine))
    # Then each gives generate's tokens, with the model's own log-probabilities, and the
    # 64 tokens of the system prompt's whole blocks ran once
    for name, prompt in prompts.items():
        assert got[name] == generate(llama, prompt, 8), name
        if name != "q0":
            kept = [lp for _, lp, *_ in engine.logprobs(name)]
            assert kept == pytest.approx(reference(llama, prompt, got[name]), abs=1e-4), name
    run = sum(len(p) for p in prompts.values()) - 4 * 64
    assert engine.prefilled == run and cache.hit_tokens == 4 * 64


def test_salted_prompts_share_neither_blocks_nor_a_prefill(llama: Any) -> None:
    # the same prompt under two salts and none: each prefilled in full, each the same
    # greedy text; under the same salt again, it takes that salt's blocks
    rng = random.Random(5)
    prompt = [rng.randrange(3, 300) for _ in range(40)]
    cache = PrefixCache(capacity=512, block=16)
    engine = PaddedEngine(llama, eos_token_ids=[EOS], step_tokens=64, max_running=8,
                          prefix_cache=cache)  # fmt: skip
    for name, salt in (("a", "s1"), ("b", "s2"), ("c", None)):
        engine.add(name, prompt, 6, Sampling(), salt=salt)
    got = _until_done(engine)
    assert engine.prefilled == 3 * len(prompt) and engine.shared == 0
    assert cache.hit_tokens == 0 and got["a"] == got["b"] == got["c"] == generate(llama, prompt, 6)
    engine.add("d", prompt, 6, Sampling(), salt="s2")
    got.update(_until_done(engine))
    assert cache.hit_tokens == 32 and got["d"] == got["b"]
    assert [engine.cached(s) for s in "abcd"] == [0, 0, 0, 32]  # (OpenAI's cached_tokens)
    # the same salt, arriving together: one prefill
    engine.add("e", [*prompt, 7], 6, Sampling(), salt="s3")
    engine.add("f", [*prompt, 7], 6, Sampling(), salt="s3")
    engine.add("g", [*prompt, 7], 6, Sampling(), salt="s4")
    before = engine.prefilled
    got.update(_until_done(engine))
    assert engine.prefilled - before == 2 * (len(prompt) + 1) and got["e"] == got["f"] == got["g"]
    assert sorted(engine.cached(s) for s in "efg") == [0, 0, len(prompt) + 1]  # f took e's
    engine.forget("d")
    assert engine.cached("d") == 0


def test_a_waiting_prompt_reports_only_the_uncached_part_as_prefill(llama: Any) -> None:
    # Given a prompt whose first 48 tokens are held, added behind a long prefill
    prompt = list(range(5, 60))  # 55 tokens
    cache = PrefixCache(capacity=256, block=16)
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=20, max_running=4,
                          prefix_cache=cache)  # fmt: skip
    engine.add("warm", prompt, 1, Sampling())
    _until_done(engine)
    engine.add("long", list(range(100, 160)), 4, Sampling())
    engine.add("s", [*prompt[:48], 7, 8], 4, Sampling())
    engine.add("scored", [*prompt[:48], 7, 8], 4, Sampling(), score=0)
    # Then, before it begins, the scheduler sees 48 tokens in its cache and 2 to prefill
    # (the scored one, which will not use the cache, all 50); once begun, what it holds
    assert engine.state("s") == SeqState(context=48, prefill_left=2)
    assert engine.state("scored") == SeqState(context=0, prefill_left=50)
    assert cache.hit_tokens == 0  # a peek, not a lookup
    engine.step()
    engine.step()
    engine.step()
    st = engine.state("s")
    assert st is not None and st.context >= 48
    assert _until_done(engine)["s"] == generate(llama, [*prompt[:48], 7, 8], 4)


def reference(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each generated token's log-probability, from one full forward."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens[:-1]], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1 :]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(tokens)]


def test_a_sampled_request_draws_the_same_tokens_from_cached_blocks(llama: Any) -> None:
    prompt = list(range(5, 60))

    def draw(cache: PrefixCache | None) -> list[int]:
        engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=64, max_running=4,
                              prefix_cache=cache)  # fmt: skip
        engine.add("warm", [*prompt[:48], 7], 2, Sampling())
        _until_done(engine)
        engine.add("s", prompt, 12, Sampling(temperature=1.1, seed=9))
        return _until_done(engine)["s"]

    cache = PrefixCache(capacity=256, block=16)
    assert draw(cache) == draw(None)
    assert cache.hit_tokens == 48


def test_a_preempted_sequence_resumes_from_its_own_blocks(llama: Any) -> None:
    prompt = list(range(9, 49))  # 40 tokens
    want = generate(llama, prompt, 30)
    cache = PrefixCache(capacity=256, block=8)
    engine = PaddedEngine(llama, eos_token_ids=[EOS], step_tokens=64, max_running=4,
                          prefix_cache=cache)  # fmt: skip
    tokens = preempted(engine, prompt, 30, 12)  # recomputed from prompt + what it generated
    before = engine.prefilled
    engine.add("r", prompt + tokens, 30 - len(tokens), Sampling(logprobs=0))
    more = _until_done(engine)["r"]
    assert tokens + more == want
    kept = [lp for _, lp, *_ in engine.logprobs("r")]
    assert kept == pytest.approx(reference(llama, prompt + tokens, more), abs=1e-4)
    assert engine.prefilled - before == len(prompt) + len(tokens) - 40  # the prompt's blocks
    assert engine.cached("r") == 0  # its own blocks, not the cache's when it began


def test_the_runner_option(tmp_path: Path) -> None:
    from batchfleet.worker.runners.generation import TextGenerationRunner

    path = make_causal_lm(tmp_path / "lm")
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={"prefix_cache_tokens": 1024, "page_size": 16})  # fmt: skip
    info = runner.info()
    assert (info["prefix_cache_tokens"], info["prefix_cache_hit_tokens"]) == (0, 0)
    assert runner.engine.prefix is not None and runner.engine.prefix.block == 16  # type: ignore[attr-defined]
    default = TextGenerationRunner(path, device="cpu", options={"kv_cache_tokens": 800})
    assert default.info()["prefix_cache_tokens"] == 0 and default.engine.prefix.capacity == 100  # type: ignore[attr-defined]
    off = TextGenerationRunner(path, device="cpu", options={"prefix_cache_tokens": 0})
    assert "prefix_cache_tokens" not in off.info()
    paged = TextGenerationRunner(path, device="cpu", options={"engine": "paged"})
    assert "prefix_cache_tokens" not in paged.info()
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        TextGenerationRunner(path, device="cpu", options={"prefix_cache_tokens": 64,
                                                          "engine": "paged"})  # fmt: skip
    # a request's cache_salt reaches the engine: a salted prompt does not take the
    # unsalted one's blocks; the same salt again does
    from batchfleet.schemas.messages import Request
    from test_generation_runner import run

    words = " ".join(f"w{i}" for i in range(40))
    ask = [Request(id=k, model="lm", inputs=[words], max_new_tokens=2, cache_salt=salt)
           for k, salt in (("plain", None), ("s1", "tenant-1"), ("s1b", "tenant-1"))]  # fmt: skip
    hits, cached = [], []
    for request in ask:
        (out,) = run(runner, request)[request.id]
        hits.append(runner.info()["prefix_cache_hit_tokens"])
        cached.append(out["cached_tokens"])
    assert hits[0] == hits[1] == 0 < hits[2]
    assert cached == [0, 0, hits[2]] and hits[2] % 16 == 0  # whole blocks


def test_reset_prefix_cache_empties_it_before_the_next_step(tmp_path: Path) -> None:
    """vLLM's ``reset_prefix_cache`` (``bf_reset_prefix_cache``): asked from any thread,
    done by the device thread before its next step; a model without one says so."""
    from batchfleet.schemas.messages import Request
    from batchfleet.worker.runners.generation import TextGenerationRunner
    from test_generation_runner import run

    path = make_causal_lm(tmp_path / "lm")
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={"prefix_cache_tokens": 1024, "page_size": 16})  # fmt: skip
    words = " ".join(f"w{i}" for i in range(40))

    def cached(rid: str) -> int:
        request = Request(id=rid, model="lm", inputs=[words], max_new_tokens=2)
        (out,) = run(runner, request)[rid]
        return int(out["cached_tokens"])

    # Given a prompt whose blocks the cache holds (the second time, taken from it)
    assert cached("a") == 0 and cached("b") > 0
    held = runner.info()["prefix_cache_tokens"]
    # When the cache is reset: held until the next step, which empties it first
    assert runner.reset_prefix_cache() is True
    assert runner.info()["prefix_cache_tokens"] == held
    # Then the same prompt is prefilled whole, and cached again after
    assert cached("c") == 0 and cached("d") > 0
    other = TextGenerationRunner(path, device="cpu", options={"prefix_cache_tokens": 0})
    assert other.reset_prefix_cache() is False  # (the paged engine's: test_paged_prefix.py)
