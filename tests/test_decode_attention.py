"""The CPU decode attention kernel: each row attends over its own length and gives what
sdpa gives over the padded batch with a mask, for grouped-query attention and for a
column slice of a wider cache buffer; the padded engine uses it in its decode steps and
leaves prefill, other dtypes and generate's steps to sdpa."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from batchfleet.worker.generation import decode_attention  # noqa: E402
from batchfleet.worker.generation.padded import PaddedEngine  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402


class _Module(torch.nn.Module):  # what an attention layer offers the function
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _reference(q: Any, k: Any, v: Any, lengths: list[int], scale: float) -> Any:
    """sdpa over the padded batch, every key past a row's length masked."""
    heads = q.shape[1]
    kv = k.shape[1]
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    keys = k[:, :, :width].repeat_interleave(heads // kv, dim=1)
    values = v[:, :, :width].repeat_interleave(heads // kv, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask[:, None, None, :], scale=scale
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize("sliced", [True, False], ids=["buffer-slice", "contiguous"])
@pytest.mark.parametrize("threads", [1, 2, 3], ids=["1-thread", "2-threads", "3-threads"])
def test_each_row_attends_over_its_own_length_like_masked_sdpa(
    heads: int, kv_heads: int, sliced: bool, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (with torch's thread count above 1, the row-heads are split over that many threads)
    decode_attention.kernel()
    parallel, calls = decode_attention._parallel, []
    assert parallel is not None, "numba has a threading layer here"

    def counted(*args: Any) -> None:
        calls.append(args[-1])
        parallel(*args)

    monkeypatch.setattr(decode_attention, "_parallel", counted)
    monkeypatch.setattr(decode_attention, "PARALLEL_MIN_KEYS", 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _attends_like_masked_sdpa(heads, kv_heads, sliced)
    finally:
        torch.set_num_threads(previous)
    most = decode_attention._numba.config.NUMBA_NUM_THREADS  # the cores, by default
    assert calls == ([] if threads == 1 else [min(threads, most)])


def _attends_like_masked_sdpa(heads: int, kv_heads: int, sliced: bool) -> None:
    torch.manual_seed(heads * 10 + kv_heads)
    rows, dim = 7, 32
    lengths = [1, 5, 64, 17, 33, 2, 40]
    width = max(lengths)
    capacity = 96 if sliced else width
    k_buf = torch.randn(rows, kv_heads, capacity, dim)
    v_buf = torch.randn(rows, kv_heads, capacity, dim)
    k_buf[:, :, width:] = float("nan")  # never read
    v_buf[:, :, width:] = float("nan")
    k, v = k_buf[:, :, :width], v_buf[:, :, :width]
    q = torch.randn(rows, heads, 1, dim)
    scale = 0.3
    got, _ = decode_attention.attention(
        _Module(heads // kv_heads), q, k, v, None, scaling=scale,
        **{decode_attention.LENGTHS: torch.tensor(lengths).numpy()},
    )  # fmt: skip
    want = _reference(q, k_buf, v_buf, lengths, scale)
    assert got.shape == (rows, 1, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
def test_bfloat16_keys_and_values_are_read_as_their_float32_values(
    heads: int, kv_heads: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a kv_cache_dtype cache: the kernel widens what it reads, so it gives exactly what it
    # gives over float32 keys and values of the same numbers, and what sdpa gives on them
    monkeypatch.setattr(decode_attention, "PARALLEL_MIN_KEYS", 0)
    torch.manual_seed(heads + kv_heads)
    rows, dim, capacity = 6, 24, 80
    lengths = [1, 7, 63, 2, 80, 31]  # odd lengths, one as long as the buffer
    k_buf = torch.randn(rows, kv_heads, capacity, dim).to(torch.bfloat16)
    v_buf = (torch.randn(rows, kv_heads, capacity, dim) * 3).to(torch.bfloat16)
    width = max(lengths)
    q = torch.randn(rows, heads, 1, dim)
    lens = {decode_attention.LENGTHS: torch.tensor(lengths).numpy()}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, _ = decode_attention.attention(
            _Module(heads // kv_heads), q, k_buf[:, :, :width], v_buf[:, :, :width], None,
            scaling=0.4, **lens,
        )  # fmt: skip
        wide, _ = decode_attention.attention(
            _Module(heads // kv_heads), q, k_buf.float()[:, :, :width],
            v_buf.float()[:, :, :width], None, scaling=0.4, **lens,
        )  # fmt: skip
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, wide)
    want = _reference(q, k_buf.float(), v_buf.float(), lengths, 0.4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
def test_long_rows_every_remainder_of_four_keys_and_far_apart_scores_like_masked_sdpa(
    dtype: Any, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the kernel takes keys four at a time, then the rest one by one, and computes exp by a
    # polynomial: rows of 1-7 keys and long ones that four does not divide, at the
    # benchmark's head shape; in the long rows one key points along a query, so at scale 1
    # every other exp(score - max) of that query is below float32's smallest normal number
    monkeypatch.setattr(decode_attention, "PARALLEL_MIN_KEYS", 0)
    torch.manual_seed(5)
    lengths = [1, 2, 3, 4, 5, 6, 7, 1000, 997, 515, 130]
    rows, heads, kv_heads, dim, capacity = len(lengths), 4, 2, 64, 1024
    q = torch.randn(rows, heads, 1, dim)
    k_buf = torch.randn(rows, kv_heads, capacity, dim)
    for r in range(7, rows):
        k_buf[r, 0, lengths[r] // 2] = 10 * q[r, 0, 0]  # the first query head's: 10 |q|^2
    k_buf = k_buf.to(dtype)
    v_buf = (torch.randn(rows, kv_heads, capacity, dim) * 2).to(dtype)
    width = max(lengths)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for scale in (0.125, 1.0):  # the model's own (1 / sqrt(dim)), and wider
            got, _ = decode_attention.attention(
                _Module(heads // kv_heads), q, k_buf[:, :, :width], v_buf[:, :, :width], None,
                scaling=scale, **{decode_attention.LENGTHS: torch.tensor(lengths).numpy()},
            )  # fmt: skip
            want = _reference(q, k_buf.float(), v_buf.float(), lengths, scale)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(previous)


def test_sdpa_reads_bfloat16_keys_widened_to_the_query_s_dtype() -> None:
    # the prefill's attention (and the decode's off the kernel) over a bfloat16 cache
    torch.manual_seed(2)
    q = torch.randn(1, 4, 5, 16)
    k, v = torch.randn(1, 2, 5, 16).to(torch.bfloat16), torch.randn(1, 2, 5, 16).to(torch.bfloat16)
    got, _ = decode_attention.attention(_Module(2), q, k, v, None)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1), is_causal=True
    ).transpose(1, 2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


def test_without_lengths_or_for_a_query_block_it_is_sdpa() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)
    calls: list[int] = []
    real = decode_attention._kernel
    decode_attention._kernel = lambda *a: calls.append(1)
    try:
        for kwargs in ({}, {decode_attention.LENGTHS: torch.tensor([3, 3]).numpy()}):
            got, _ = decode_attention.attention(_Module(2), q, k, v, None, **kwargs)
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
            ).transpose(1, 2)
            torch.testing.assert_close(got, want)
    finally:
        decode_attention._kernel = real
    assert calls == []


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_causal_lm(tmp_path_factory.mktemp("llama"))


def test_the_engine_runs_its_decodes_through_the_kernel_and_generate_is_untouched(
    llama_dir: Any,
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    engine = PaddedEngine(model, eos_token_ids=[], step_tokens=64, max_running=4)
    assert engine.row_attention
    assert model.config._attn_implementation == decode_attention.ATTENTION
    calls: list[int] = []
    real = decode_attention._kernel

    def counting(*args: Any) -> None:
        calls.append(args[0].shape[0])
        real(*args)

    decode_attention._kernel = counting
    try:
        engine.add("a", [5, 6, 7], 4, Sampling())
        engine.add("b", list(range(3, 40)), 4, Sampling())
        engine.step()  # two prefills (sdpa); the lean fused step joins them after it
        assert engine.lean is not None and calls == []
        engine.step()  # one decode over both rows, every layer
        assert calls == [2] * model.config.num_hidden_layers
        calls.clear()
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
        assert calls == []
    finally:
        decode_attention._kernel = real


def test_a_bfloat16_model_keeps_sdpa(llama_dir: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16).eval()
    engine = PaddedEngine(model, eos_token_ids=[], step_tokens=64, max_running=4)
    assert not engine.row_attention
    assert model.config._attn_implementation == "sdpa"
    engine.add("a", [5, 6, 7], 3, Sampling())
    outs = [o for _ in range(3) for o in engine.step()]
    assert outs[-1].finished and len(outs[-1].tokens) == 3


def test_a_sliding_window_model_keeps_sdpa() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           sliding_window=8)  # fmt: skip
    model = MistralForCausalLM(config).eval()
    assert not decode_attention.usable(model)
    config.sliding_window = None
    assert decode_attention.usable(model)


@pytest.mark.parametrize("lengths", [[3, 6], [0, 3]], ids=["past-the-keys", "no-keys"])
def test_a_row_length_past_the_keys_or_of_none_is_refused_not_read(lengths: list[int]) -> None:
    q, k, v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention.attention(
            _Module(1), q, k, v, None, **{decode_attention.LENGTHS: torch.tensor(lengths).numpy()}
        )


def test_starting_the_kernels_leaves_torchs_thread_count_alone() -> None:
    # numba's first parallel call starts its OpenMP threads and sets the caller's OpenMP
    # thread count to numba's maximum; torch reads it unless set_num_threads was called, so
    # a process told OMP_NUM_THREADS=1 went on with 2 threads in the thread that loaded a
    # model. A fresh process: the kernels start once per process.
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from batchfleet.worker.generation import decode_attention as da\n"
        "assert da.kernel() is not None and da._parallel is not None\n"
        "print(torch.get_num_threads())\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    assert out.stdout.split() == ["1"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_step_planned_once_writes_each_layer_into_its_rows_of_a_shared_output(
    dtype: Any,
) -> None:
    # the lean forward plans a step's rows once (rows) and each layer's kernel writes into
    # the first rows of one attention output (attend_rows): what attention() returns there,
    # the rows after (prefill chunks') untouched; lengths that do not fit are refused
    torch.manual_seed(7)
    rows, heads, kv_heads, dim, capacity = 5, 4, 2, 16, 40
    lengths = [3, 40, 1, 17, 9]
    plan = decode_attention.rows(torch.tensor(lengths).numpy(), kv_heads)
    assert plan is not None and plan.longest == 40
    out = torch.full((rows + 3, heads * dim), 7.0)
    for layer in range(2):
        q = torch.randn(rows, heads, 1, dim)
        k = torch.randn(rows, kv_heads, capacity, dim).to(dtype)
        v = torch.randn(rows, kv_heads, capacity, dim).to(dtype)
        decode_attention.attend_rows(plan, q, k, v, 0.3, out[:rows])
        want, _ = decode_attention.attention(
            _Module(heads // kv_heads), q, k, v, None, scaling=0.3,
            **{decode_attention.LENGTHS: torch.tensor(lengths).numpy()},
        )  # fmt: skip
        assert torch.equal(out[:rows], want.reshape(rows, heads * dim)), layer
    assert torch.equal(out[rows:], torch.full((3, heads * dim), 7.0))
    with pytest.raises(ValueError, match="do not fit"):  # keys narrower than a row's length
        decode_attention.attend_rows(plan, q, k[:, :, :39], v[:, :, :39], 0.3, out[:rows])
    with pytest.raises(ValueError, match="needs a key"):
        decode_attention.rows(torch.tensor([2, 0]).numpy(), kv_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_buffers_arrays_made_once_attend_as_its_column_slices_do(dtype: Any) -> None:
    # the lean forward reads a cache buffer through the arrays made with it (arrays), the
    # step's first rows of them whole (attend_arrays): the same numbers as attend_rows over
    # the step's column slice of the same buffer; what does not fit is refused
    torch.manual_seed(11)
    rows, heads, kv_heads, dim, capacity = 4, 4, 2, 16, 48
    lengths = np.array([30, 2, 19, 7], dtype=np.int64)
    plan = decode_attention.rows(lengths, kv_heads)
    assert plan is not None
    k = torch.randn(rows + 2, kv_heads, capacity, dim).to(dtype)  # more rows than the step's
    v = torch.randn(rows + 2, kv_heads, capacity, dim).to(dtype)
    keys, values = decode_attention.arrays(k), decode_attention.arrays(v)
    assert keys is not None and values is not None
    k[1, 0, 1] = 5.0  # the same memory: a write after the arrays are made is read
    q = torch.randn(rows, heads, 1, dim)
    want = torch.empty(rows, heads * dim)
    decode_attention.attend_rows(plan, q, k[:rows, :, :30], v[:rows, :, :30], 0.3, want)
    got = torch.full((rows + 1, heads * dim), 7.0)
    decode_attention.attend_arrays(plan, q, keys[:rows], values[:rows], 0.3, got[:rows].numpy())
    assert torch.equal(got[:rows], want)
    assert torch.equal(got[rows], torch.full((heads * dim,), 7.0))
    with pytest.raises(ValueError, match="do not fit"):  # the buffer's rows, not the step's
        decode_attention.attend_arrays(plan, q, keys, values, 0.3, got[:rows].numpy())
    with pytest.raises(ValueError, match="do not fit"):  # narrower than the longest row
        decode_attention.attend_arrays(plan, q, keys[:rows, :, :29].copy(),
                                       values[:rows, :, :29].copy(), 0.3, got[:rows].numpy())  # fmt: skip
    assert decode_attention.arrays(k.to(torch.float16)) is None  # a dtype it cannot read
    assert decode_attention.arrays(k[:, :, :30]) is None  # not a whole buffer
