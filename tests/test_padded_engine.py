"""The padded continuous-batching engine, stepped directly: greedy tokens equal
one-at-a-time ``generate`` for Llama, Qwen2 (biased projections) and GPT-2 (each with
sharp attention: its query and key projections scaled up, so a misplaced key shows) with sequences
joining and leaving at different steps, through the lean step forward and through
transformers' own, each with the per-row attention kernel and with sdpa over the padded
batch (as on a GPU), and with their linear layers in bfloat16 (``matmul_precision``
``medium``); chunked prefill keeps running rows decoding; cancelled rows leave at
the next step; the batch narrows when its longest row leaves."""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchfleet.worker import precision  # noqa: E402
from batchfleet.worker.generation import decode_attention, reserve  # noqa: E402
from batchfleet.worker.generation.engine import SeqState, seq_state  # noqa: E402
from batchfleet.worker.generation.padded import PaddedEngine  # noqa: E402
from batchfleet.worker.generation.padded_cache import SlabLayer  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

EOS = 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_llama(tmp_path_factory)


def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny Llama (float32, on the CPU) the ``llama`` fixture gives."""
    from transformers import AutoModelForCausalLM

    path = make_causal_lm(tmp_path_factory.mktemp("llama"))
    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Llama-family model whose q, k and v projections carry a bias."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, use_sliding_window=False,
                         bos_token_id=EOS, eos_token_id=EOS, tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # random biases, not the zeros a fresh model starts with
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):  # sharp attention
                proj.weight.mul_(12.0)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_gpt2(tmp_path_factory)


def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny GPT-2 (float32, on the CPU, sharp attention) the ``gpt2`` fixture gives."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=300, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=EOS, eos_token_id=EOS)  # fmt: skip
    path = tmp_path_factory.mktemp("gpt2")
    model = GPT2LMHeadModel(config)
    with torch.no_grad():  # sharp attention: the query and key thirds of c_attn scaled up
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, : 2 * config.n_embd].mul_(12.0)
    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path).eval()


def generate(model: Any, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n,
                         do_sample=False,
                         pad_token_id=0, eos_token_id=EOS)  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :]]


def run(
    engine: PaddedEngine, arrivals: dict[int, list[tuple[str, list[int], int]]]
) -> dict[str, list[int]]:
    """Step until every sequence finished, adding ``arrivals[step]`` before each step."""
    done: dict[str, list[int]] = {}
    total = sum(len(v) for v in arrivals.values())
    step = 0
    while len(done) < total:
        for name, prompt, n in arrivals.get(step, []):
            engine.add(name, prompt, n, Sampling())
        for o in engine.step():
            if o.finished:
                done[o.sequence] = o.tokens
        step += 1
        assert step < 2000
    return done


@pytest.mark.parametrize(
    "row_attention,lean,threads,max_context",
    [(True, True, 1, None), (True, True, 2, None), (True, False, 1, None),
     (False, True, 1, None), (False, False, 1, None), (True, True, 1, 128),
     (False, True, 1, 128), (False, False, 1, 128)],
    ids=["row-attention", "row-attention-2-threads", "row-attention-transformers", "sdpa",
         "sdpa-transformers", "row-attention-reserved", "sdpa-reserved",
         "sdpa-transformers-reserved"],
)  # fmt: skip
@pytest.mark.parametrize("which", ["llama", "qwen2", "gpt2"])
def test_greedy_tokens_equal_one_at_a_time_generate(
    which: str,
    row_attention: bool,
    lean: bool,
    threads: int,
    max_context: int | None,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # lean: the decode runs the lean forward (Llama-family models; GPT-2 never does);
    # max_context: the KV buffers reserved once (sdpa reads their unwritten columns)
    if threads > 1:  # every decode's attention split over 2 threads (however short)
        monkeypatch.setattr(decode_attention, "PARALLEL_MIN_KEYS", 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = request.getfixturevalue(which)
        _greedy_tokens_equal_generate(model, row_attention, lean and which != "gpt2", max_context)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    "which,row_attention,lean",
    [("llama", True, True), ("qwen2", False, True), ("gpt2", True, False)],
    ids=["llama-row-attention", "qwen2-sdpa", "gpt2-row-attention-transformers"],
)  # fmt: skip
def test_under_matmul_precision_medium_greedy_tokens_equal_one_at_a_time_generate(
    which: str, row_attention: bool, lean: bool, request: pytest.FixtureRequest
) -> None:
    """The linear layers in bfloat16 (``matmul_precision`` ``medium``; GPT-2's ``Conv1D``
    too): the batched steps and ``generate`` of the same converted model agree."""
    model = copy.deepcopy(request.getfixturevalue(which))
    assert precision.to_bf16(model) > 0
    _greedy_tokens_equal_generate(model, row_attention, lean)


def _greedy_tokens_equal_generate(
    model: Any, row_attention: bool, lean: bool, max_context: int | None = None
) -> None:
    rng = random.Random(7)
    vocab = model.config.vocab_size
    seqs = [(f"s{i}", [rng.randrange(3, vocab) for _ in range(rng.randint(1, 70))],
             rng.randint(1, 30)) for i in range(14)]  # fmt: skip
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    for i, s in enumerate(seqs):
        arrivals.setdefault(rng.choice([0, 0, 1, 3, 5, 9, 20]) + i // 5, []).append(s)
    engine = PaddedEngine(model, eos_token_ids=[EOS], step_tokens=48, max_running=6,
                          row_attention=row_attention, lean=lean, max_context=max_context)  # fmt: skip
    assert engine.row_attention is row_attention  # a float32 model on the CPU
    assert (engine.lean is not None) is lean
    got = run(engine, arrivals)
    for name, prompt, n in seqs:
        assert got[name] == generate(model, prompt, n), name
    assert engine.running == 0 and not engine._rows
    if max_context is not None:  # reserved at its largest at the first join, never grown
        assert engine._capacity() == (6, max_context)


def test_with_its_longest_context_the_kv_buffer_is_reserved_once(llama: Any) -> None:
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=256, max_running=4,
                          max_context=300)  # fmt: skip
    engine.add("a", [5, 6, 7], 10, Sampling())
    engine.step()
    layer = engine._layers[0]
    assert layer._k is not None and engine._capacity() == (4, 300)
    where = layer._k.data_ptr()
    assert not layer._k[1:].any()  # zero where no row wrote
    for k in range(3):  # more rows and a longer context: no growth, no copy
        engine.add(f"b{k}", list(range(3, 203)), 10, Sampling())
    for _ in range(3):
        engine.step()
    assert engine.running == 4 and layer._k.data_ptr() == where


def _kv_resident(engine: PaddedEngine) -> int:
    return sum(reserve.resident_bytes(t) for layer in engine._layers for t in (layer._k, layer._v))


def _admitted_by_budget(
    engine: PaddedEngine, seqs: list[tuple[str, list[int], int]], budget: int
) -> tuple[dict[str, list[int]], int]:
    """Step ``seqs`` through, each added (in order) once the running ones' prompt and
    tokens plus its own fit ``budget`` tokens, as the policy admits; the tokens and the
    largest KV memory held after a step."""
    pending, live, got, peak = list(seqs), {}, {}, 0
    while pending or live:
        while pending and len(live) < engine.max_running:
            name, prompt, n = pending[0]
            if sum(live.values()) + len(prompt) + n > budget:
                break
            engine.add(name, prompt, n, Sampling())
            live[name] = len(prompt) + n
            pending.pop(0)
        for o in engine.step():
            if o.finished:
                got[o.sequence] = o.tokens
                del live[o.sequence]
        peak = max(peak, _kv_resident(engine) if engine._layers else 0)
    return got, peak


def test_reserved_rows_hand_back_what_they_hold_past_the_kv_budget(llama: Any) -> None:
    """Every row, once, held a long sequence: without a bound the rows keep all those
    pages (about 4 x 330 tokens), with one they hold at most the budget's (to a page per
    row and head), and the tokens stay generate's."""
    rng = random.Random(3)
    seqs = [(f"s{i}", [rng.randrange(3, 300) for _ in range(rng.choice([8, 40, 300]))],
             rng.randint(1, 30)) for i in range(24)]  # fmt: skip
    budget, rows = 500, 4
    cfg = llama.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    per_token = cfg.num_hidden_layers * 2 * heads * dim * 4  # keys and values, float32
    slack = cfg.num_hidden_layers * 2 * rows * heads * reserve.PAGE
    unbounded = PaddedEngine(llama, eos_token_ids=[], step_tokens=512, max_running=rows,
                             max_context=1024)  # fmt: skip
    _, peak_unbounded = _admitted_by_budget(unbounded, seqs, budget)
    assert peak_unbounded > budget * per_token + slack  # the case: rows keep old pages
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=512, max_running=rows,
                          max_context=1024, resident_tokens=budget)  # fmt: skip
    got, peak = _admitted_by_budget(engine, seqs, budget)
    assert peak <= budget * per_token + slack, (peak, budget * per_token + slack)
    assert engine.released_bytes > 0 and engine.resident <= budget
    for name, prompt, n in seqs:
        assert got[name] == generate(llama, prompt, n), name


@pytest.fixture(params=[True, False], ids=["fused", "separate"])
def fused(request: pytest.FixtureRequest) -> bool:
    """Whether the engine runs the lean fused step (one forward for the step's decodes
    and prefill chunks; a sequence joins after it) or transformers' forwards (prefill,
    then a decode that the sequences which just joined take part in)."""
    return bool(request.param)


def test_a_long_prompt_prefills_in_chunks_while_running_rows_decode(
    llama: Any, fused: bool
) -> None:
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=20, max_running=8, lean=fused)
    assert (engine.lean is not None) is fused
    for k in range(4):
        engine.add(f"r{k}", [5 + k, 6, 7], 200, Sampling())
    engine.step()
    assert engine.running == 4
    engine.add("long", list(range(3, 83)), 5, Sampling())  # 80 tokens, 16 per step
    for k in range(5):
        out = {o.sequence: o for o in engine.step()}
        assert {f"r{j}" for j in range(4)} <= set(out)  # one token each, every step
        state = engine.state("long")
        assert state is not None
        assert state.prefill_left == 80 - 16 * (k + 1)
    # its first token (from the prefill); separate: and the next from the step's decode
    assert "long" in out and len(out["long"].tokens) == (1 if fused else 2)
    assert engine.running == 5


def test_a_cancelled_row_leaves_at_the_next_step_and_the_batch_narrows(
    llama: Any, fused: bool
) -> None:
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=256, max_running=8, lean=fused)
    joined = 0 if fused else 1  # tokens decoded in the step a sequence joins
    engine.add("long", list(range(3, 103)), 100, Sampling())
    engine.add("short", [5, 6], 100, Sampling())
    engine.add("third", [7, 8, 9], 100, Sampling())
    engine.step()  # prefill, first tokens (separate: and one decode)
    assert engine.width == 101 + joined  # the longest row's cache and its new token
    engine.cancel(["long"])
    assert engine.state("long") is None
    out = engine.step()
    assert [o.sequence for o in out] == ["third", "short"]  # the last row filled the hole
    assert engine.running == 2 and engine.moves == 1
    assert engine.width == 3 + 1 + joined + 1  # "third": prompt, tokens fed back, the next
    engine.cancel(["short", "third"])
    assert engine.step() == [] and engine.running == 0


def test_a_waiting_sequence_can_be_cancelled_and_a_finished_one_leaves(
    llama: Any, fused: bool
) -> None:
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=256, max_running=8, lean=fused)
    engine.add("a", [5, 6, 7], 3, Sampling())
    engine.add("b", [5, 6, 7], 50, Sampling())
    engine.cancel(["b"])
    first = engine.step()  # a's first token (separate: then its first decode)
    assert [o.sequence for o in first] == ["a"] and not first[0].finished
    assert len(first[0].tokens) == (1 if fused else 2)
    if fused:
        (o,) = engine.step()
        assert len(o.tokens) == 2 and not o.finished
    (second,) = engine.step()
    assert second.finished and len(second.tokens) == 3
    assert engine.running == 0 and engine.state("a") is None


def test_a_slab_layer_grows_without_losing_what_it_holds() -> None:
    layer = SlabLayer()
    chunks = [torch.randn(2, 3, n, 4) for n in (50, 20, 1, 100)]
    for c in chunks:
        keys, values = layer.update(c, -c)
    whole = torch.cat(chunks, dim=2)
    assert torch.equal(keys, whole) and torch.equal(values, -whole)
    assert layer.get_seq_length() == 171


def preempted(engine: PaddedEngine, prompt: list[int], n: int, steps: int) -> list[int]:
    """Sequence ``r`` (``n`` new tokens) alone, preempted after ``steps`` steps: what it
    generated (it resumes from its prompt and those)."""
    engine.add("r", prompt, n, Sampling())
    tokens: list[int] = []
    for _ in range(steps):
        (o,) = engine.step()
        tokens = o.tokens
    engine.cancel(["r"])
    engine.step()
    return tokens


def test_resume_with_the_generated_tokens_continues_the_same_text(llama: Any) -> None:
    prompt = [9, 8, 7, 6]
    want = generate(llama, prompt, 12)
    engine = PaddedEngine(llama, eos_token_ids=[EOS], step_tokens=64, max_running=4)
    tokens = preempted(engine, prompt, 12, 5)  # recomputed from prompt + what it generated
    engine.add("r", prompt + tokens, 12 - len(tokens), Sampling())
    more: list[int] = []
    while True:
        (o,) = engine.step()
        more = o.tokens
        if o.finished:
            break
    assert tokens + more == want


def test_seeded_sampling_draws_from_each_requests_own_generator(llama: Any) -> None:
    def tokens(mates: int) -> list[int]:
        engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=256, max_running=8)
        engine.add("s", [5, 6, 7], 10, Sampling(temperature=1.0, seed=3))
        for k in range(mates):
            engine.add(f"m{k}", [9, 9, k + 3], 10, Sampling(temperature=0.7, seed=k))
        last: list[int] = []
        while True:
            out = {o.sequence: o for o in engine.step()}
            last = out["s"].tokens
            if out["s"].finished:
                return last

    assert tokens(0) == tokens(3)


def test_seq_state_equals_the_frozen_dataclass_it_builds_without_its_init() -> None:
    made = seq_state(10, 15)
    assert (made.context, made.prefill_left) == (10, 15)
    assert made == SeqState(context=10, prefill_left=15) and made != seq_state(15, 10)
    assert hash(made) == hash(SeqState(10, 15)) and repr(made) == repr(SeqState(10, 15))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.context = 1  # type: ignore[misc]


def test_state_counts_context_and_prefill(llama: Any, fused: bool) -> None:
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=10, max_running=4, lean=fused)
    joined = 0 if fused else 1
    engine.add("r", list(range(3, 28)), 20, Sampling())  # 25 tokens, 10 per step
    assert engine.state("r") == SeqState(context=0, prefill_left=25)
    engine.step()
    st = engine.state("r")
    assert st is not None and (st.context, st.prefill_left) == (10, 15)
    engine.step()
    engine.step()  # the last 5 prompt tokens, the first token (separate: and its decode)
    st = engine.state("r")
    assert st is not None and (st.context, st.prefill_left) == (25 + joined, 0)
    engine.step()
    st = engine.state("r")
    assert st is not None and st.context == 26 + joined


def test_a_lower_lane_prefills_first_whatever_was_added_before(llama: Any) -> None:
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=40, max_running=8)
    for k in range(3):
        engine.add(f"bulk{k}", list(range(3 + k, 43 + k)), 50, Sampling(), priority=2)
    engine.step()  # bulk0 prefilled (40 tokens, the whole budget)
    engine.add("urgent", list(range(3, 33)), 50, Sampling(), priority=0)
    out = {o.sequence for o in engine.step()}
    assert "urgent" in out and "bulk1" not in out  # first token before bulk1's
    st = engine.state("bulk1")
    assert st is not None and st.prefill_left > 0


def test_a_step_that_ends_a_lane_0_prompt_takes_no_lower_lane_prefill(
    llama: Any, fused: bool
) -> None:
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=64, max_running=8, lean=fused)
    engine.add("bulk", list(range(3, 43)), 5, Sampling(), priority=1)
    engine.add("u1", list(range(3, 23)), 5, Sampling(), priority=0)
    engine.add("u2", list(range(5, 15)), 5, Sampling(), priority=0)
    out = {o.sequence for o in engine.step()}
    assert out == {"u1", "u2"}  # both lane-0 prompts end: the budget had room for bulk too
    st = engine.state("bulk")
    assert st is not None and st.prefill_left == 40  # it starts next step
    out = {o.sequence for o in engine.step()}
    assert "bulk" in out and engine.running == 3


def test_sequences_with_the_same_prompt_prefill_once(llama: Any, fused: bool) -> None:
    # a request's n completions (sampled, each its own seed) and a greedy duplicate: the
    # prompt runs once (in chunks, while another row decodes), each twin draws its own text
    prompt = list(range(3, 43))  # 40 tokens: 3 steps at 16 a step
    seeds = (4, 5, 6)

    def alone(sampling: Sampling) -> list[int]:
        engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=20, max_running=8, lean=fused)
        engine.add("x", prompt, 6, sampling)
        return _until_done(engine)["x"]

    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=20, max_running=8, lean=fused)
    engine.add("other", [7, 8, 9], 30, Sampling())
    engine.step()
    for j, seed in enumerate(seeds):
        engine.add(f"c{j}", prompt, 6, Sampling(temperature=1.2, seed=seed))
    engine.add("g", prompt, 6, Sampling())
    engine.add("longer", [*prompt, 11], 6, Sampling())  # not a twin
    got = _until_done(engine)
    assert engine.prefilled == 3 + 2 * len(prompt) + 1 and engine.shared == 3 * len(prompt)
    for j, seed in enumerate(seeds):
        assert got[f"c{j}"] == alone(Sampling(temperature=1.2, seed=seed))
    assert len({tuple(got[f"c{j}"]) for j in range(3)}) > 1
    assert got["g"] == generate(llama, prompt, 6)
    assert got["longer"] == generate(llama, [*prompt, 11], 6)


def test_twins_without_a_free_row_prefill_on_their_own(llama: Any, fused: bool) -> None:
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=64, max_running=2, lean=fused)
    prompt = [5, 6, 7, 8]
    for k in range(3):
        engine.add(f"t{k}", prompt, 4, Sampling())
    got = _until_done(engine)
    assert got == {f"t{k}": generate(llama, prompt, 4) for k in range(3)}
    assert engine.shared == len(prompt) and engine.prefilled == 2 * len(prompt)


def _until_done(engine: PaddedEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(500):
        for o in engine.step():
            if o.finished:
                done[o.sequence] = o.tokens
        if not engine.running and not engine._waiting:
            return done
    raise AssertionError("did not finish")


def test_prompt_logprobs_are_the_model_s_own_through_chunks(llama: Any, fused: bool) -> None:
    from batchfleet.worker.generation.prefix_cache import PrefixCache

    # Given a 57-token prompt scored in chunks beside a decoding row, its twin (same
    # tokens, not scored), and a prefix cache that already holds the prompt's blocks
    prompt = list(range(3, 60))
    cache = PrefixCache(capacity=256, block=16)
    engine = PaddedEngine(llama, eos_token_ids=[], step_tokens=20, max_running=4, lean=fused,
                          prefix_cache=cache)  # fmt: skip
    engine.add("warm", prompt, 1, Sampling())
    _until_done(engine)
    engine.add("other", [7, 8, 9], 30, Sampling())
    engine.step()
    ran = engine.prefilled
    engine.add("s", prompt, 4, Sampling(), score=3)
    engine.add("twin", prompt, 4, Sampling())
    got = _until_done(engine)
    # Then each prompt token after the first has its log-probability under the model
    # (one full forward) and the 3 likeliest tokens at its position; the scored prompt
    # ran in full, the twin took its cached blocks; both give generate's tokens
    with torch.inference_mode():
        lp = torch.log_softmax(llama(torch.tensor([prompt])).logits[0].float(), dim=-1)
    kept = engine.prompt_logprobs("s")
    assert [t for t, *_ in kept] == prompt[1:]
    want = [float(lp[i, t]) for i, t in enumerate(prompt[1:])]
    assert [v for _, v, *_ in kept] == pytest.approx(want, abs=1e-4)
    for i, (_, _, ids, values, _) in enumerate(kept):
        assert values == pytest.approx(lp[i].topk(3).values.tolist(), abs=1e-4)
        assert values == pytest.approx(lp[i, ids].tolist(), abs=1e-4)
    assert got["s"] == got["twin"] == generate(llama, prompt, 4)
    assert engine.prefilled - ran == len(prompt) + len(prompt) - 48
    assert engine.prompt_logprobs("twin") == []
    engine.forget("s")
    assert engine.prompt_logprobs("s") == []
