"""Device and dtype choice, host→device copies, and recognising out-of-memory errors."""

from __future__ import annotations

import gc
import os

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


CUDNN_ATTENTION_ENV = "BATCHFLEET_CUDNN_ATTENTION"
"""Set to ``1`` to leave cuDNN's attention kernels on (:func:`configure_cuda`)."""


def pick_device(wanted: str) -> torch.device:
    """``auto`` → ``cuda`` when a GPU is visible, else ``cpu``; anything else as given.
    A CUDA device is configured for the worker's changing shapes (:func:`configure_cuda`)."""
    if wanted == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(wanted)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {wanted!r} asked for, but CUDA is not available")
    if device.type == "cuda":
        configure_cuda()
    return device


def configure_cuda() -> bool:
    """Turn cuDNN's attention off in this process (unless ``BATCHFLEET_CUDNN_ATTENTION=1``);
    True when it is off.

    cuDNN builds an execution plan for every new input shape, and a worker's shapes change
    all the time: each generation step's key length grows by one, each encoder batch pads
    to its own width. Measured on an H200 (torch 2.11, bf16, ``bench/gpu_probe.py``): a
    decode step of the benchmark's 4-layer Llama at 32 rows took 83.6 ms with it (79 ms of
    it in the 4 attention calls' host time; 0.4 ms of kernels) and 3.8 ms without; HF
    ``generate`` at one row 62.8 ms against 3.6 ms. torch then uses its flash or
    memory-efficient kernels, which need no plan. Process-wide, as torch's switch is."""
    off = os.environ.get(CUDNN_ATTENTION_ENV, "") != "1"
    torch.backends.cuda.enable_cudnn_sdp(not off)
    return off


def pick_dtype(wanted: str, device: torch.device) -> torch.dtype:
    """``auto`` → float16 on CUDA (bfloat16 where supported), float32 on CPU."""
    if wanted == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return DTYPES[wanted]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device``; from pinned memory, asynchronously, on CUDA
    (tensors from :class:`~.host_buffers.HostBuffers` are pinned already)."""
    if device.type == "cuda":
        if not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)
    return tensor


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA OOM, host ``MemoryError``, and allocator failures torch reports as text."""
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def release_cached_memory(device: torch.device) -> None:
    """After an OOM (its exception and traceback dropped), free what the failed call left
    (a collection, for tensors in reference cycles) and give cached blocks back, so the
    retry can allocate."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def keep_freed_memory() -> bool:
    """Ask glibc malloc to keep freed memory instead of giving it back to the OS.

    A generation step allocates and frees the same tensors every few milliseconds; with
    glibc's defaults the freed top of the heap is trimmed and large blocks are unmapped,
    so every step faults its memory in again (measured: 27 s of a device thread's 70 s in
    the kernel, `bench/generation.py`). Same effect as starting the process with
    ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_`` set. No-op (False) where
    the C library is not glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = mallopt(m_trim_threshold, ctypes.c_int(2**31 - 1))
    ok &= mallopt(m_mmap_threshold, ctypes.c_int(32 * 1024 * 1024))  # glibc's maximum
    return bool(ok)
