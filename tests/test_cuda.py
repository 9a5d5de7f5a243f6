"""On a CUDA device only (skipped elsewhere; ``bench/gpu_check.sh`` runs them on a lent
GPU): the padded engine's greedy tokens there, pinned host buffers, and a real
out-of-memory error splitting a batch."""

from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from batchfleet.producer import Producer
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runners.embedding import EmbeddingRunner
from test_padded_engine import _greedy_tokens_equal_generate, gpt2, llama, qwen2  # noqa: F401
from tiny_models import WORDS, _tokenizer, vocab

from batchfleet.config import ModelConfig, WorkerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("which", ["llama", "qwen2", "gpt2"])
def test_padded_engine_greedy_tokens_equal_generate_on_cuda(
    which: str, lean: bool, request: pytest.FixtureRequest
) -> None:
    # Given the padded engine over a float32 model on the GPU (sdpa over the padded batch),
    # stepping through the lean forward (Llama-family) or transformers' forwards
    model = copy.deepcopy(request.getfixturevalue(which)).to("cuda")
    # Then requests arriving at different steps get one-at-a-time generate's tokens there
    _greedy_tokens_equal_generate(model, row_attention=False, lean=lean and which != "gpt2")


def test_encoder_inputs_come_from_pinned_buffers_and_match_the_cpu(tiny_embedder: Path) -> None:
    gpu = EmbeddingRunner(tiny_embedder, device="cuda", dtype="float32", max_tokens=32)
    cpu = EmbeddingRunner(tiny_embedder, device="cpu", dtype="float32", max_tokens=32)
    assert gpu.torch_device.type == "cuda" and gpu._buffers.pinned
    texts = [" ".join(WORDS[i : i + 3 + i % 7]) for i in range(24)]
    want = cpu.run(cpu.encode(texts))
    got = gpu.run(gpu.encode(texts))
    allocations = gpu._buffers.allocations
    for _ in range(3):  # batches no larger than the first reuse its buffers
        assert gpu.run(gpu.encode(texts[:10])) == gpu.run(gpu.encode(texts[:10]))
    assert gpu._buffers.allocations == allocations
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-4)


@pytest.fixture()
def wide_embedder(tmp_path: Path) -> Path:
    """A one-layer BERT wide enough that a batch's activations dwarf the allocator's
    segment sizes (about 9 MB a row at 512 tokens, bf16, measured on an H200)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab()), hidden_size=1024, num_hidden_layers=1,
                        num_attention_heads=8, intermediate_size=4096,
                        max_position_embeddings=512)  # fmt: skip
    BertModel(config).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    return tmp_path


def _extra_peak(runner: EmbeddingRunner, texts: list[str]) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    runner.run(runner.encode(texts))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_a_real_out_of_memory_splits_the_batch(wide_embedder: Path, r: redis.Redis) -> None:
    # Given a model whose full batch (32 rows) needs more memory than the process may
    # take, while about 12 rows fit (peaks measured: a fixed part and a part per row)
    runner = EmbeddingRunner(wide_embedder, device="cuda", max_tokens=512)
    text = " ".join(WORDS[i % len(WORDS)] for i in range(500))
    small, large = _extra_peak(runner, [text] * 4), _extra_peak(runner, [text] * 32)
    per_row = (large - small) / 28
    assert per_row > 0.1 * small, (small, large)  # it grows with the rows
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    allowed = torch.cuda.memory_reserved() + small + 8 * per_row
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            runner.run(runner.encode([text] * 32))
        gc.collect()  # the failed call's tensors, held by the traceback pytest kept
        torch.cuda.empty_cache()
        # When 96 such requests are queued at once
        jobs = Producer(client=r).submit_many("wide", [text] * 96, priority=0)
        loop = _run_loop(r, runner)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    # Then every request succeeds, split into batches that fit
    results = [j.result(timeout=1) for j in jobs]
    assert all(res.ok for res in results), [res.error for res in results if not res.ok][:3]
    assert loop.stats.oom_events >= 1
    assert max(res.timings.batch_size for res in results) > 12


def _run_loop(r: redis.Redis, handler: Any) -> BatchLoop:
    cfg = ModelConfig(path="/unused", max_tokens=512)
    loop = BatchLoop("wide", cfg, handler, r, consumer="w1",
                     worker=WorkerConfig(block_ms=50), burst=True)  # fmt: skip
    loop.run()
    return loop
