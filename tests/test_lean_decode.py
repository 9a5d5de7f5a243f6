"""The lean step forward (``worker/generation/lean_decode.py``): built for Llama-family
layers and refused for anything else; its logits are exactly transformers' for a padded
batch of rows of different lengths, through the per-row kernel and through sdpa under a
padding mask (any device or dtype: a bfloat16 model here), and with the linear layers in
bfloat16 (``matmul_precision`` ``medium``: the same mixed products); its own RMS norm runs
only where it gives the modules' numbers; decodes and prefill chunks in
one forward each get transformers' logits and cache; one whose first step fails gives way
to transformers' forwards; the runner's ``lean_decode`` option turns it off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchfleet.worker import precision  # noqa: E402
from batchfleet.worker.generation import decode_attention  # noqa: E402
from batchfleet.worker.generation.lean_decode import LeanDecoder  # noqa: E402
from batchfleet.worker.generation.padded import PaddedEngine  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("llama"), layers=3)


def _llama(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _running(
    llama_dir: Path, n: int, lean: bool, dtype: Any = None, medium: bool = False
) -> tuple[Any, LeanDecoder, PaddedEngine]:
    """The model, its lean forward, and an engine running ``n`` rows of different
    lengths, three steps in (``lean``: the engine's own steps fused; ``medium``: its
    linear layers in bfloat16, ``matmul_precision`` ``medium``)."""
    model = _llama(llama_dir)
    if dtype is not None:
        model = model.to(dtype)
    if medium:
        assert precision.to_bf16(model) > 0
    decoder = LeanDecoder.build(model)
    assert decoder is not None
    engine = PaddedEngine(model, eos_token_ids=[], step_tokens=512, max_running=8, lean=lean)
    for k in range(n):
        engine.add(f"r{k}", [(7 * k + j) % 300 + 3 for j in range(5 + 23 * k)], 50, Sampling())
    for _ in range(3):
        engine.step()
    return model, decoder, engine


@pytest.mark.parametrize("medium", [False, True], ids=["float32", "medium"])
def test_its_logits_are_transformers_logits_for_rows_of_different_lengths(
    llama_dir: Path, medium: bool
) -> None:
    import numpy as np

    model, lean, engine = _running(llama_dir, 5, lean=False, medium=medium)
    assert (lean.layers[0].qkv.dtype == torch.bfloat16) is medium
    rows = engine._rows
    lengths = [r.context for r in rows]
    assert len(set(lengths)) == 5  # a padded batch: every row its own length
    ids = torch.tensor([[r.generated[-1]] for r in rows])
    positions = torch.tensor(lengths)
    st = engine._step
    st.rows, st.width, st.positions, st.flat = len(rows), max(lengths), positions, None
    keys = np.asarray(lengths, dtype=np.int64) + 1
    with torch.inference_mode():
        # both write the same new keys and values at the same columns
        got = lean.logits(ids, positions, keys, engine._layers)
        want = model(input_ids=ids, position_ids=positions[:, None], cache=engine._cache,
                     use_cache=True, logits_to_keep=1,
                     **{decode_attention.LENGTHS: keys}).logits[:, -1]  # fmt: skip
    assert got.shape == (5, model.config.vocab_size)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_through_sdpa_its_logits_are_transformers_padded_batch_logits(
    llama_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np
    from batchfleet.worker.generation.lean_decode import padding_mask

    # Given rows of different lengths whose decode attends with sdpa over the padded batch
    # (where the per-row kernel does not run: a GPU, or a 16-bit model)
    monkeypatch.setattr(decode_attention, "usable", lambda model: False)
    model, lean, engine = _running(llama_dir, 5, lean=False, dtype=getattr(torch, dtype))
    assert not engine.row_attention
    rows = engine._rows
    lengths = [r.context for r in rows]
    assert len(set(lengths)) == 5
    ids = torch.tensor([[r.generated[-1]] for r in rows])
    positions = torch.tensor(lengths)
    st = engine._step
    st.rows, st.width, st.positions, st.flat = len(rows), max(lengths), positions, None
    keys = np.asarray(lengths, dtype=np.int64) + 1
    mask = padding_mask(positions, max(lengths))
    with torch.inference_mode():
        # When the lean forward and transformers' forward (the engine's own mask) run it
        got = lean.logits(ids, positions, keys, engine._layers, mask)
        want = model(input_ids=ids, attention_mask=mask[:, 0, 0], position_ids=positions[:, None],
                     cache=engine._cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # fmt: skip
    # Then the logits are transformers' (bfloat16: to its rounding, q/k/v in one product)
    assert got.shape == (5, model.config.vocab_size) and got.dtype == getattr(torch, dtype)
    if dtype == "float32":
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got.float(), want.float(), atol=0.05, rtol=0.02)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_16_bit_model_on_the_cpu_steps_through_the_lean_forward(llama_dir: Path) -> None:
    from batchfleet.worker.runners.generation import TextGenerationRunner

    runner = TextGenerationRunner(llama_dir, device="cpu", dtype="bfloat16")
    engine = runner.engine
    assert runner.info()["decode"] == "lean" and not engine.row_attention  # type: ignore[attr-defined]


@pytest.mark.parametrize("medium", [False, True], ids=["float32", "medium"])
def test_one_forward_of_decodes_and_prefill_chunks_gives_each_its_own_logits_and_cache(
    llama_dir: Path, medium: bool
) -> None:
    """Decode rows, a fresh chunk and a chunk continuing its prompt, in one forward: each
    decode row's logits are what the decode alone gives; each chunk's last-token logits
    and the keys and values it appends are what transformers' prefill gives."""
    import numpy as np
    from batchfleet.worker.generation.lean_decode import Chunk
    from batchfleet.worker.generation.padded_cache import _cache
    from transformers import DynamicCache

    model, lean, engine = _running(llama_dir, 3, lean=True, medium=medium)
    rows = engine._rows
    lengths = [r.context for r in rows]
    ids = torch.tensor([r.generated[-1] for r in rows])
    positions = torch.tensor(lengths)
    keys = np.asarray(lengths, dtype=np.int64) + 1
    fresh = [(11 * j) % 300 + 3 for j in range(37)]
    prompt = [(13 * j) % 300 + 3 for j in range(60)]
    with torch.inference_mode():
        # transformers: the second prompt's first 25 tokens, then its last 35; the first's
        head = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prompt[:25]]), cache=head, use_cache=True)
        past = _cache(reserve=60)
        none = torch.zeros(0, dtype=torch.long)  # no decode rows
        lean.forward(none, none, np.zeros(0, np.int64), [], [Chunk(prompt[:25], 0, past)])
        for mine, theirs in zip(past.layers, head.layers, strict=True):
            assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
        want_fresh = model(input_ids=torch.tensor([fresh]), logits_to_keep=1).logits[0, -1]
        want_rest = model(input_ids=torch.tensor([prompt[25:]]), cache=head, use_cache=True,
                          position_ids=torch.arange(25, 60)[None], logits_to_keep=1)  # fmt: skip
        st = engine._step
        st.rows, st.width, st.positions, st.flat = len(rows), max(lengths), positions, None
        want_rows = lean.logits(ids[:, None], positions, keys, engine._layers)
        st.flat = None  # the same columns written again, by the fused forward
        got = lean.forward(ids, positions, keys, engine._layers,
                           [Chunk(fresh, 0, _cache()), Chunk(prompt[25:], 25, past)])  # fmt: skip
    assert got.shape == (len(rows) + 2, model.config.vocab_size)
    assert torch.allclose(got[: len(rows)], want_rows, atol=1e-5)
    assert torch.allclose(got[len(rows)], want_fresh, atol=1e-5)
    assert torch.allclose(got[len(rows) + 1], want_rest.logits[0, -1], atol=1e-5)
    for mine, theirs in zip(past.layers, head.layers, strict=True):
        assert mine.get_seq_length() == 60
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
        assert torch.allclose(mine.values, theirs.values, atol=1e-5)


def test_it_is_refused_for_layers_it_does_not_know(llama_dir: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    assert LeanDecoder.build(_llama(llama_dir)) is not None
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1,
                                      n_head=2))  # fmt: skip
    assert LeanDecoder.build(gpt2) is None

    class Adapted(torch.nn.Linear):  # e.g. a LoRA or quantized projection
        pass

    adapted = _llama(llama_dir)
    old = adapted.model.layers[1].self_attn.v_proj
    adapted.model.layers[1].self_attn.v_proj = Adapted(old.in_features, old.out_features,
                                                       bias=False)  # fmt: skip
    assert LeanDecoder.build(adapted) is None

    renamed = _llama(llama_dir)
    renamed.config.model_type = "gemma"  # a family whose layers differ (norm offsets)
    assert LeanDecoder.build(renamed) is None


def test_q_and_k_rotate_in_one_pass_only_where_that_is_the_familys_formula(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    model = _llama(llama_dir)
    decoder = LeanDecoder.build(model)
    assert decoder is not None and decoder.rotate_half is not None
    # a family whose apply_rotary_pos_emb is another formula: its own function, q and k apart
    module = sys.modules[type(model).__module__]

    def other(q: Any, k: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
        return q * cos - q * sin, k * cos - k * sin

    monkeypatch.setattr(module, "apply_rotary_pos_emb", other)
    decoder = LeanDecoder.build(model)
    assert decoder is not None and decoder.rotate_half is None and decoder.rotate is other


def test_its_own_norm_runs_only_where_it_gives_the_modules_numbers(llama_dir: Path) -> None:
    from batchfleet.worker.generation.lean_decode import _rms, _rms_exact

    # a float32 Llama: every norm through the lean forward's own (fewer tensors made)
    model = _llama(llama_dir)
    decoder = LeanDecoder.build(model)
    assert decoder is not None and decoder.rms
    norm = model.model.norm
    x = torch.randn(2, 7, norm.weight.shape[0])
    with torch.inference_mode():
        assert torch.equal(_rms(norm, x), norm(x))

    class Offset(type(norm)):  # type: ignore[misc]  # a family scaling by 1 + weight
        def forward(self, hidden: Any) -> Any:
            return super().forward(hidden) * (1 + self.weight) / self.weight

    norm.__class__ = Offset
    assert not _rms_exact(norm)
    assert not LeanDecoder.build(model).rms  # type: ignore[union-attr]
    # a 16-bit model: its norms' modules (they compute in float32 and round)
    half = LeanDecoder.build(_llama(llama_dir).to(torch.bfloat16))
    assert half is not None and not half.rms


def _tokens(engine: PaddedEngine, prompt: list[int], n: int) -> list[int]:
    engine.add("a", prompt, n, Sampling())
    out: list[int] = []
    while not out or engine.running != 0:
        for o in engine.step():
            out = o.tokens
    return out


def test_a_lean_forward_failing_on_its_first_step_gives_way_to_transformers_forwards(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchfleet.worker.generation.lean_decode import LeanDecoder

    prompt = [(5 * j) % 300 + 3 for j in range(20)]
    want = _tokens(PaddedEngine(_llama(llama_dir), eos_token_ids=[], step_tokens=512,
                                max_running=4, lean=False), prompt, 6)  # fmt: skip

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no kernel for this device")

    # Given a lean forward that cannot run here (a device or dtype it was never checked on)
    engine = PaddedEngine(_llama(llama_dir), eos_token_ids=[], step_tokens=512, max_running=4)
    assert engine.lean is not None
    monkeypatch.setattr(LeanDecoder, "forward", broken)
    engine.add("a", prompt, 6, Sampling())
    # When its first step fails, that step fails (the runner fails its requests, resets)
    with pytest.raises(RuntimeError, match="no kernel"):
        engine.step()
    engine.reset()
    # Then the engine goes on with transformers' forwards, and gets their tokens
    assert engine.lean is None
    assert _tokens(engine, prompt, 6) == want

    # but once it has run a step, a later failure is that step's alone: it stays lean
    monkeypatch.undo()
    kept = PaddedEngine(_llama(llama_dir), eos_token_ids=[], step_tokens=512, max_running=4)
    kept.add("a", prompt, 6, Sampling())
    kept.step()
    monkeypatch.setattr(LeanDecoder, "forward", broken)
    with pytest.raises(RuntimeError, match="no kernel"):
        kept.step()
    assert kept.lean is not None

    # and so does one whose first step ran out of memory (the runner retries smaller)
    def short(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(LeanDecoder, "forward", short)
    fresh = PaddedEngine(_llama(llama_dir), eos_token_ids=[], step_tokens=512, max_running=4)
    fresh.add("a", prompt, 6, Sampling())
    with pytest.raises(torch.OutOfMemoryError):
        fresh.step()
    assert fresh.lean is not None


def test_the_runner_uses_it_unless_told_not_to(llama_dir: Path) -> None:
    from batchfleet.worker.runners.generation import TextGenerationRunner

    on = TextGenerationRunner(llama_dir, device="cpu")
    off = TextGenerationRunner(llama_dir, device="cpu", options={"lean_decode": False})
    assert on.info()["decode"] == "lean" and on.engine.lean is not None  # type: ignore[attr-defined]
    assert off.info()["decode"] == "transformers" and off.engine.lean is None  # type: ignore[attr-defined]


def _steps_logits(engine: PaddedEngine, arrivals: dict[int, list[tuple[str, list[int], int]]],
                  steps: int) -> list[Any]:  # fmt: skip
    """Each step's lean forward logits while ``arrivals`` (by step) join and rows leave."""
    assert engine.lean is not None
    seen: list[Any] = []
    forward = engine.lean.forward

    def kept(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        seen.append(out.clone())
        return out

    engine.lean.forward = kept  # type: ignore[method-assign]
    for step in range(steps):
        for name, prompt, n in arrivals.get(step, []):
            engine.add(name, prompt, n, Sampling())
        engine.step()
    return seen


def test_the_buffers_arrays_made_once_give_the_logits_of_fresh_views_as_rows_join_and_leave(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the lean forward attends through each cache buffer's arrays, made once with the
    # buffer (decode_attention.arrays), not views made anew each layer and step: as rows
    # join (a long one growing the buffers), leave (the last row moved into a hole) and
    # new ones take the freed rows, every step's logits are those of an engine that makes
    # the views each time (attend_rows), bit for bit
    def prompt(k: int, n: int) -> list[int]:
        return [(7 * k + 3 * j) % 300 + 3 for j in range(n)]

    arrivals = {0: [("a", prompt(0, 9), 6), ("b", prompt(1, 40), 30), ("c", prompt(2, 17), 4)],
                3: [("d", prompt(3, 280), 12)],  # past the buffers' 256 columns: they grow
                6: [("e", prompt(4, 5), 20), ("f", prompt(5, 60), 9)],
                12: [("g", prompt(6, 33), 8)]}  # fmt: skip
    calls = []
    attend_arrays = decode_attention.attend_arrays

    def counted(*args: Any) -> None:
        calls.append(1)
        attend_arrays(*args)

    monkeypatch.setattr(decode_attention, "attend_arrays", counted)
    engine = PaddedEngine(_llama(llama_dir), eos_token_ids=[], step_tokens=64, max_running=8)
    got = _steps_logits(engine, arrivals, 30)
    layer = engine._layers[0]
    assert layer._k is not None and layer.arrays is not None
    assert layer.arrays[0].ctypes.data == layer._k.data_ptr()  # the grown buffer's own
    assert engine.moves > 0 and layer._k.shape[2] > 256 and calls
    monkeypatch.setattr(decode_attention, "arrays", lambda t: None)
    fresh = PaddedEngine(_llama(llama_dir), eos_token_ids=[], step_tokens=64, max_running=8)
    want = _steps_logits(fresh, arrivals, 30)
    assert fresh._layers[0].arrays is None
    assert len(got) == len(want) == 30
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), step
