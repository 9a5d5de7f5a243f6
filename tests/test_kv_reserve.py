"""Reserved KV memory (``worker/generation/reserve.py``): zeroed, writable, kept alive by
its views, and taken from the OS only where written."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from batchfleet.worker.generation import reserve  # noqa: E402


def _resident_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4


def test_reserved_zeros_are_zero_writable_and_outlive_their_first_tensor() -> None:
    like = torch.ones(1, 2, 3, 4)
    t = reserve.zeros((4, 2, 50, 4), like)
    assert t.shape == (4, 2, 50, 4) and t.dtype == like.dtype and not t.any()
    t[1, :, :7] = 2.5
    view = t[1:2, :, :10]
    del t
    gc.collect()
    assert float(view.sum()) == 2.5 * 2 * 7 * 4  # the mapping lives while a view does


def test_other_dtypes_and_an_empty_shape() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        t = reserve.zeros((3, 5), torch.ones(1, dtype=dtype))
        assert t.dtype == dtype and not t.any()
    assert reserve.zeros((0, 5), torch.ones(1)).shape == (0, 5)


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="Linux only")
def test_only_written_pages_take_memory() -> None:
    before = _resident_kib()
    t = reserve.zeros((64, 4, 4096, 64), torch.ones(1))  # 256 MiB of address space
    assert float(t[:, :, :4096:512].sum()) == 0.0  # reading maps the shared zero page
    t[:2, :, :16] = 1.0  # 2 x 4 (row, head) runs of 16 x 64 floats: a page each
    grown = _resident_kib() - before
    assert grown < 16 * 1024, f"{grown} KiB resident for 32 KiB written"
