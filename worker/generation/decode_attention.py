"""Decode attention for the padded engine on CPU: each row attends over its own length.

A decode step asks one query per row to attend over that row's keys. ``torch``'s CPU
attention (``scaled_dot_product_attention``) takes the batch padded to its longest row
and a mask; on the benchmark's mixed lengths it reads about twice the keys and values a
row has, at about a quarter of the memory bandwidth (``python -m bench.generation``,
decode step cost table). This kernel, compiled by numba, reads only each row's
``length`` keys and values, once per key-value head for all the query heads sharing it
(grouped-query attention), with a numerically stable softmax. With more than one torch
thread, a step's row-heads are dealt to that many numba threads (the OpenMP pool torch's
linear layers use), so attention scales with the cores as they do.

Keys and values may be bfloat16 (the engine's ``kv_cache_dtype``): the kernel reads them
as their bit patterns and widens each element to float32 in a register as it reads it (a
bfloat16 is a float32's upper half), so it computes what it computes over float32 keys
holding the same values, reading half the bytes.

The kernel takes keys four at a time, so its loops over ``dim`` vectorize (AVX2) with
four independent sums and one load of a query's row, or of an accumulator's, serves four
keys; and it computes ``exp`` by a polynomial inlined in the loop over scores, so that
loop vectorizes too (``np.exp`` is a scalar call per score here: no vector math library).
``python -m bench.decode_kernel`` against the kernel before (one key at a time, a
horizontal sum per key and query head, ``np.exp``): on the tiny Llama's saturated decode
shapes (32 rows, 4 layers' buffers), one thread, on a shared and busy 2-core AMD EPYC:
36-44 ns per key per key-value head against 51-72 over bfloat16 (1.4-1.6x), and
49-63 against 55-63 over float32 (1.0-1.1x: reading the keys and values from memory is
most of it); with the keys in cache (8 rows, 1 layer), 1.6x over float32, 2x over
bfloat16. The engine alone on the benchmark's trace spent 0.87 CPU ms per output token
against 1.31 (``python -m bench.decode_kernel engine``, medians of 6 interleaved runs).

It is used as a transformers attention function (``ATTENTION``, registered at import)
that falls back to ``sdpa`` for everything but a float32 CPU decode step the padded
engine marked with :data:`LENGTHS` (the engine's prefill, CUDA, other dtypes, softcapping,
sliding windows and attention sinks all take ``sdpa``, over keys and values widened to
the query's dtype: :func:`sdpa`). The lean forward (:mod:`.lean_decode`) calls the
kernel directly instead: :func:`rows` checks a step's lengths and picks its threads once
for all layers, and :func:`attend_rows` writes each layer's rows into the step's own
attention output (no per-layer checks, allocation or concatenation).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

logger = logging.getLogger(__name__)

ATTENTION = "batchfleet_padded"
"""The attention implementation name the padded engine gives its model."""
LENGTHS = "batchfleet_lengths"
"""The forward keyword carrying each row's key count (a ``numpy`` int64 array)."""

_UNSUPPORTED = ("softcap", "sliding_window", "s_aux", "position_bias")
_KERNEL_KV = (torch.float32, torch.bfloat16)
"""The key and value dtypes the kernel reads (a bfloat16 ``kv_cache_dtype`` cache: half
the bytes)."""
_KERNEL_ARRAYS = (np.dtype(np.float32), np.dtype(np.uint16))
"""The same as the arrays it is given (bfloat16 as its bits)."""


def _compile(cache: bool) -> tuple[Any, Any]:
    """The serial kernel and the parallel one (row-heads dealt round-robin to ``parts``
    numba threads, each with its own scratch), sharing one compiled body."""
    import numba

    from .numba_bits import as_float32, widen

    jit = numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=cache)

    @jit
    def exp(x: Any) -> Any:
        """``exp(x)`` for ``x <= 0`` as ``2**n * p(r)`` (``r`` within ``ln2 / 2``, ``p``
        its Taylor polynomial to ``r**7``): within 3e-7 relative, and inlined, so a loop
        over scores vectorizes (``np.exp`` is a call per score without a vector math
        library). Below ``-87`` it gives ``2**-126``, not less: nothing next to ``exp(0)``."""
        x = max(x, np.float32(-87.0))
        n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
        r = x - n * np.float32(0.693145751953125) - n * np.float32(1.428606765330187e-06)
        p = np.float32(1.0 / 5040)
        for c in (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
            p = p * r + np.float32(c)
        return p * as_float32((np.int32(n) + np.int32(127)) << 23)

    @jit
    def one(q: Any, k: Any, v: Any, n: int, scale: float, out: Any, s: Any,
            acc: Any) -> None:  # fmt: skip
        """One row-head: ``out[g] = softmax(q[g] . k[:n] * scale) @ v[:n]`` (q, out:
        ``group x dim``; k, v: ``keys x dim``, float32 or bfloat16 bits widened as read;
        scratch: s, ``group x keys``, and acc, ``group x dim``). Keys go four at a time,
        so the loops over ``dim`` vectorize with four independent sums, a query's row is
        loaded once for four keys and an ``acc`` row once for four values."""
        group, dim = q.shape
        whole = n - n % 4
        for j in range(0, whole, 4):
            for g in range(group):
                x0 = x1 = x2 = x3 = np.float32(0.0)
                for d in range(dim):
                    qd = q[g, d]
                    x0 += qd * widen(k[j, d])
                    x1 += qd * widen(k[j + 1, d])
                    x2 += qd * widen(k[j + 2, d])
                    x3 += qd * widen(k[j + 3, d])
                s[g, j], s[g, j + 1] = x0 * scale, x1 * scale
                s[g, j + 2], s[g, j + 3] = x2 * scale, x3 * scale
        for j in range(whole, n):
            for g in range(group):
                x = np.float32(0.0)
                for d in range(dim):
                    x += q[g, d] * widen(k[j, d])
                s[g, j] = x * scale
        for g in range(group):  # a numerically stable softmax, normalized at the end
            top = s[g, 0]
            for j in range(1, n):
                top = max(top, s[g, j])
            for j in range(n):
                s[g, j] = exp(s[g, j] - top)
            for d in range(dim):
                acc[g, d] = 0.0
        for j in range(0, whole, 4):
            for g in range(group):
                p0, p1, p2, p3 = s[g, j], s[g, j + 1], s[g, j + 2], s[g, j + 3]
                for d in range(dim):
                    acc[g, d] += (p0 * widen(v[j, d]) + p1 * widen(v[j + 1, d])
                                  + p2 * widen(v[j + 2, d]) + p3 * widen(v[j + 3, d]))  # fmt: skip
        for j in range(whole, n):
            for g in range(group):
                p = s[g, j]
                for d in range(dim):
                    acc[g, d] += p * widen(v[j, d])
        for g in range(group):
            total = np.float32(0.0)
            for j in range(n):
                total += s[g, j]
            inv = np.float32(1.0) / total
            for d in range(dim):
                out[g, d] = acc[g, d] * inv

    @jit
    def attend(q: Any, k: Any, v: Any, lengths: Any, scale: float, out: Any) -> None:
        """``out[r, h, g] = softmax(q[r, h, g] . k[r, h, :n] * scale) @ v[r, h, :n]`` with
        ``n = lengths[r]``; q, out: ``rows x kv_heads x group x dim``; k, v: ``rows x
        kv_heads x width x dim``, float32 or bfloat16 seen as ``uint16``."""
        rows, heads, group, dim = q.shape
        s = np.empty((group, k.shape[2]), np.float32)
        acc = np.empty((group, dim), np.float32)
        for r in range(rows):
            for h in range(heads):
                one(q[r, h], k[r, h], v[r, h], lengths[r], scale, out[r, h], s, acc)

    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=cache, parallel=True)
    def attend_parallel(
        q: Any, k: Any, v: Any, lengths: Any, scale: float, out: Any, parts: int
    ) -> None:
        """:func:`attend` on ``parts`` threads: part ``t`` takes row-heads ``t``, ``t +
        parts``, ... (round-robin, so long and short rows spread evenly)."""
        rows, heads, group, dim = q.shape
        for t in numba.prange(parts):
            s = np.empty((group, k.shape[2]), np.float32)
            acc = np.empty((group, dim), np.float32)
            for i in range(t, rows * heads, parts):
                r, h = i // heads, i % heads
                one(q[r, h], k[r, h], v[r, h], lengths[r], scale, out[r, h], s, acc)

    return attend, attend_parallel


PARALLEL_MIN_KEYS = 2048
"""Key-value-head reads (keys over all rows, times key-value heads) from which a step's
attention is split over torch's thread count; below it a thread team costs more than it
saves."""

_kernel: Any = None
_parallel: Any = None
_numba: Any = None
_lock = threading.Lock()


def kernel() -> Any:
    """The compiled serial kernel (compiled, or loaded from numba's cache, on first use,
    with the parallel one beside it); None where numba is not installed or cannot compile
    here."""
    global _kernel, _parallel, _numba
    with _lock:
        if _kernel is None:
            _kernel = False
            # cached beside the module, or in numba's user-wide cache; else compiled anew
            for cache in (True, False):
                try:
                    attend, parallel = _compile(cache)
                    q = np.zeros((2, 1, 1, 4), np.float32)
                    kv = np.zeros((2, 1, 2, 4), np.float32)
                    half = np.zeros((2, 1, 2, 4), np.uint16)  # bfloat16 keys and values
                    lengths = np.ones(2, np.int64)
                    attend(q, kv, kv, lengths, np.float32(1.0), q.copy())
                    attend(q, half, half, lengths, np.float32(1.0), q.copy())
                    _kernel = attend
                except Exception as exc:  # ImportError, no cache location, no compiler
                    logger.warning("CPU decode attention (numba, cache=%s) failed: %s", cache, exc)
                    continue
                # numba's first parallel call starts its OpenMP threads and leaves the calling
                # thread's OpenMP thread count (torch's too) at numba's maximum: put it back
                threads = torch.get_num_threads()
                try:
                    import numba

                    parallel(q, kv, kv, lengths, np.float32(1.0), q.copy(), 2)
                    parallel(q, half, half, lengths, np.float32(1.0), q.copy(), 2)
                    _parallel, _numba = parallel, numba
                except Exception as exc:  # no threading layer: one thread
                    logger.warning("CPU decode attention runs on one thread: %s", exc)
                finally:
                    torch.set_num_threads(threads)
                break
            if _kernel is False:
                logger.warning("CPU decode attention unavailable: the padded engine uses sdpa")
        return _kernel or None


def _parts(work: int) -> int:
    """How many threads a step's attention of ``work`` row-heads runs on: torch's thread
    count (what its linear layers use), at most one per row-head and numba's maximum; 1
    where the parallel kernel is unavailable."""
    threads = torch.get_num_threads()
    if threads < 2 or work < 2 or _parallel is None:
        return 1
    parts = min(threads, work, _numba.config.NUMBA_NUM_THREADS)
    if _numba.get_num_threads() != parts:  # per calling thread
        _numba.set_num_threads(parts)
    return int(parts)


def usable(model: Any) -> bool:
    """Whether the padded engine can give ``model`` this attention: a float32 model on the
    CPU using ``sdpa`` (or already this), every layer full attention without softcapping
    (the decode then passes no padding mask), and the kernel compiles here."""
    try:
        param = next(model.parameters())
    except (StopIteration, AttributeError):
        return False
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    plain = not any(
        getattr(config, name, None) for name in ("sliding_window", "attn_logit_softcapping")
    ) and all(t == "full_attention" for t in getattr(config, "layer_types", None) or ())
    return (
        param.device.type == "cpu"
        and param.dtype == torch.float32
        and impl in ("sdpa", ATTENTION)
        and plain
        and kernel() is not None
    )


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: the kernel for a marked decode step, else sdpa."""
    lengths = kwargs.pop(LENGTHS, None)
    attend = (_kernel or kernel()) if lengths is not None else None
    if (
        attend is None
        or query.shape[2] != 1
        or query.dtype != torch.float32
        or key.dtype not in _KERNEL_KV
        or value.dtype != key.dtype
        or query.device.type != "cpu"
        or dropout
        or any(kwargs.get(name) is not None for name in _UNSUPPORTED)
    ):
        if lengths is not None and attention_mask is None and query.shape[2] == 1:
            # the engine built no padding mask for this decode: sdpa would attend padding
            raise RuntimeError("a decode step marked for per-row attention cannot use it here")
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    **kwargs)  # fmt: skip
    rows, heads, _, dim = query.shape
    plan = Rows(lengths, _parts_for(lengths, key.shape[1]), int(lengths.max()))
    if len(lengths) != rows or int(lengths.min()) <= 0 or plan.longest > key.shape[2]:
        # the kernel reads unchecked, and a row without keys has no softmax
        raise ValueError(f"row lengths {lengths} do not fit keys of shape {tuple(key.shape)}")
    out = torch.empty((rows, heads * dim), dtype=query.dtype)
    attend_rows(plan, query, key, value, dim**-0.5 if scaling is None else scaling, out)
    return out.view(rows, heads, 1, dim).transpose(1, 2), None


@dataclass(frozen=True, slots=True)
class Rows:
    """A decode step's per-row attention, checked once for all its layers (the lean
    forward's: :func:`rows`): each row's key count, the threads, the longest row."""

    lengths: np.ndarray
    parts: int
    longest: int


def rows(lengths: np.ndarray, kv_heads: int) -> Rows | None:
    """The step's :class:`Rows` for ``lengths`` (each row's key count, all positive:
    else ValueError, as the kernel reads unchecked); None where the kernel is unavailable."""
    if (_kernel or kernel()) is None:
        return None
    if not len(lengths) or int(lengths.min()) <= 0:
        raise ValueError(f"row lengths {lengths}: each row needs a key")
    return Rows(lengths, _parts_for(lengths, kv_heads), int(lengths.max()))


def attend_rows(plan: Rows, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float, out: torch.Tensor) -> None:  # fmt: skip
    """The kernel's attention of decode rows ``query`` (``rows x heads x 1 x dim``, float32
    on the CPU) over ``key`` and ``value`` (``rows x kv_heads x columns x dim``, float32 or
    bfloat16), written into ``out``, a C-contiguous ``rows x (heads * dim)`` float32 (the
    lean forward's rows of its attention output: no copy after)."""
    if (
        key.dtype not in _KERNEL_KV or value.dtype != key.dtype or plan.longest > key.shape[2]
        or not out.is_contiguous()
    ):  # fmt: skip
        raise ValueError(f"row lengths {plan.lengths} do not fit keys {tuple(key.shape)} "
                         f"{key.dtype} or an output {tuple(out.shape)}")  # fmt: skip
    attend_arrays(plan, query, _whole(_bits(key)), _whole(_bits(value)), scaling, out.numpy())


def arrays(t: torch.Tensor) -> np.ndarray | None:
    """A ``rows x kv_heads x capacity x dim`` CPU cache buffer as the array
    :func:`attend_arrays` reads (the same memory; bfloat16 as its bits), made once where
    the buffer is, so a step's layers skip :func:`attend_rows`' per-call views; None for
    a buffer the kernel cannot read."""
    if t.device.type != "cpu" or t.dtype not in _KERNEL_KV or not t.is_contiguous():
        return None
    return np.asarray(_bits(t).numpy())


def attend_arrays(plan: Rows, query: torch.Tensor, keys: np.ndarray, values: np.ndarray,
                  scaling: float, out: np.ndarray) -> None:  # fmt: skip
    """:func:`attend_rows` over whole rows of cache buffers as :func:`arrays` gives them
    (``keys[r]``: row ``r``'s, its first ``plan.lengths[r]`` columns read), written into
    ``out``, a C-contiguous ``rows x (heads * dim)`` float32 array."""
    rows, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    if (
        keys.dtype not in _KERNEL_ARRAYS or keys.dtype != values.dtype
        or keys.shape != values.shape or len(keys) != rows
        or plan.longest > keys.shape[2] or len(plan.lengths) != rows
        or out.shape != (rows, heads * dim) or not out.flags.c_contiguous
    ):  # fmt: skip
        raise ValueError(f"row lengths {plan.lengths} do not fit keys {keys.shape} "
                         f"{keys.dtype} or an output {out.shape}")  # fmt: skip
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim).contiguous().numpy()
    target = out.reshape(rows, kv_heads, heads // kv_heads, dim)
    if plan.parts > 1:
        _parallel(q, keys, values, plan.lengths, np.float32(scaling), target, plan.parts)
    else:
        _kernel(q, keys, values, plan.lengths, np.float32(scaling), target)


def _parts_for(lengths: np.ndarray, kv_heads: int) -> int:
    """:func:`_parts` for a step of ``lengths``, 1 below :data:`PARALLEL_MIN_KEYS`."""
    work = len(lengths) * kv_heads
    return _parts(work) if int(lengths.sum()) * kv_heads >= PARALLEL_MIN_KEYS else 1


def sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention over keys and values stored in another dtype than
    the query's (a ``kv_cache_dtype`` cache): read widened to the query's, as the kernel
    reads them (sdpa takes one dtype)."""
    if key.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    return sdpa_attention_forward(  # type: ignore[no-any-return]
        module, query, key, value, attention_mask, **kwargs
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A bfloat16 tensor as its bit patterns (``uint16``: numpy has no bfloat16; the
    kernel widens them); a float32 one as it is."""
    return t.view(torch.uint16) if t.dtype == torch.bfloat16 else t


def _whole(t: torch.Tensor) -> Any:
    """``t`` as a C-contiguous array: a column slice of a ``rows x heads x capacity x dim``
    buffer (the padded engine's cache) becomes that buffer's first ``rows`` rows, so the
    kernel indexes with constant strides (3-4x faster than a strided view); anything else
    is copied."""
    rows, heads, _, dim = t.shape
    s = t.stride()
    if s[3] == 1 and s[2] == dim and s[1] % dim == 0 and s[0] == heads * s[1]:
        capacity = s[1] // dim
        end = t.storage_offset() + rows * s[0]
        if end * t.element_size() <= t.untyped_storage().nbytes():
            return t.as_strided((rows, heads, capacity, dim), s).numpy()
    return t.contiguous().numpy()


AttentionInterface.register(ATTENTION, attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
