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
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

MAP_NORESERVE = 0x4000 if sys.platform == "linux" else 0
"""Linux's flag (x86 and arm alike; Python 3.11's ``mmap`` does not name it)."""


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
    return torch.frombuffer(buf, dtype=like.dtype).view(shape)
