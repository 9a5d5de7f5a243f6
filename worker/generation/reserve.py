"""Zeroed CPU buffers whose memory the OS provides only where it is written.

A padded KV buffer sized for its largest use (``max_running`` rows of the longest context)
is mostly never written: rows are as long as their sequences. Taken with ``torch.zeros``,
every page of it is faulted in and cleared at once; taken as it grows (doubling), every
growth faults in a whole new buffer and frees the old one to the OS, which faults it in
again next time. On the virtual machines this runs on a first-touch page fault costs about
6 microseconds (3 GB zeroed: 5.5 s in the kernel), and a fresh generating worker spent 14%
of its device thread in the kernel doing this (``bench/generation.py``, SmolLM2).

An anonymous private mapping is zero by the OS's contract and takes physical memory page by
page as it is first written; reading a page never written maps the shared zero page. So
the buffer is reserved once at its largest size and never grows or copies, and holds only
what rows have written. ``MAP_NORESERVE`` (Linux) keeps the reservation out of the
overcommit accounting: it is address space, not memory.

Pages once written stay with the process until :func:`release` hands them back
(``MADV_DONTNEED``: the range reads zero again and takes no memory until written); the
padded engine releases what its rows no longer use when their written columns add up to
more than the KV budget (``padded.py``).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
import weakref

import numpy as np
import torch

MAP_NORESERVE = 0x4000 if sys.platform == "linux" else 0
"""Linux's flag (x86 and arm alike; Python 3.11's ``mmap`` does not name it)."""

PAGE = mmap.PAGESIZE

_MAPS: dict[int, mmap.mmap] = {}
"""The mapping behind each tensor :func:`zeros` mapped (by the tensor's ``id``, dropped
when it goes)."""


def zeros(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A zeroed tensor of ``shape`` with ``like``'s dtype and device: on CPU, backed by
    an anonymous mapping (module docstring); elsewhere, or where the mapping is refused
    (strict overcommit), ``new_zeros``."""
    if like.device.type != "cpu":
        return like.new_zeros(shape)
    nbytes = math.prod(shape) * like.element_size()
    if nbytes == 0:
        return like.new_zeros(shape)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except OSError:
        return like.new_zeros(shape)
    # the tensor holds the mapping: it is unmapped when the last view of it goes
    t = torch.frombuffer(buf, dtype=like.dtype).view(shape)
    _MAPS[id(t)] = buf
    weakref.finalize(t, _MAPS.pop, id(t), None)
    return t


def mapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a buffer :func:`zeros` mapped (so :func:`release` can free it)."""
    return id(t) in _MAPS and hasattr(mmap, "MADV_DONTNEED")


def release(t: torch.Tensor, row: int, start: int, stop: int) -> int:
    """Hand the OS back the pages of columns ``start:stop`` of row ``row`` of a ``rows x
    heads x width x dim`` buffer from :func:`zeros` (whole pages inside the range; they
    read zero afterwards); the bytes released. Other tensors: nothing (0)."""
    buf = _MAPS.get(id(t))
    if buf is None or stop <= start or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    size = t.element_size()
    rs, hs, cs = (t.stride(i) * size for i in range(3))
    origin = t.data_ptr() - _address(buf)
    if start == 0 and stop >= t.shape[2]:  # the whole row: one contiguous range
        spans = [(origin + row * rs, origin + (row + 1) * rs)]
    else:
        at = origin + row * rs
        spans = [(at + h * hs + start * cs, at + h * hs + stop * cs) for h in range(t.shape[1])]
    freed = 0
    for lo, hi in spans:
        lo, hi = -(-lo // PAGE) * PAGE, hi // PAGE * PAGE
        if hi > lo:
            buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            freed += hi - lo
    return freed


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of a :func:`zeros` buffer's pages now mapped (``mincore``; Linux): what
    it holds of the machine, not of the address space, except that a page only read maps
    the shared zero page and counts too. Other tensors: their size."""
    buf = _MAPS.get(id(t))
    if buf is None or sys.platform != "linux":
        return int(t.numel() * t.element_size())
    pages = -(-len(buf) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mincore(ctypes.c_void_p(_address(buf)), ctypes.c_size_t(len(buf)), vec)
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int((np.frombuffer(memoryview(vec).cast("B"), dtype=np.uint8) & 1).sum()) * PAGE


def _address(buf: mmap.mmap) -> int:
    """Where the mapping starts in the address space."""
    return int(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
