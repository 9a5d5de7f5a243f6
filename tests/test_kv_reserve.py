"""Reserved KV memory (``worker/generation/reserve.py``): zeroed, writable, kept alive by
its views, taken from the OS only where written, and handed back by row and columns."""

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


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="Linux only")
def test_released_columns_read_zero_and_leave_memory() -> None:
    t = reserve.zeros((8, 4, 4096, 64), torch.ones(1))  # a (row, head) run: 1 MiB, 256 pages
    assert reserve.mapped(t) and reserve.resident_bytes(t) == 0
    t[:4] = 1.0
    assert reserve.resident_bytes(t) == 16 << 20
    before = _resident_kib()
    # row 1 from column 1000: 64 columns a page, so the page holding 1000-1007 stays
    freed = reserve.release(t, 1, 1000, 4096)
    assert freed == 4 * (4096 - 1008) * 256
    assert reserve.release(t, 2, 0, 4096) == 4 << 20  # a whole row: one range
    # (before reading them: a read maps the shared zero page, which mincore counts)
    assert reserve.resident_bytes(t) == (16 << 20) - freed - (4 << 20)
    gone = before - _resident_kib()
    assert gone > (freed + (4 << 20)) // 1024 * 0.9, f"{gone} KiB left the process"
    assert bool((t[1, :, :1008] == 1.0).all()) and not t[1, :, 1008:].any()
    assert not t[2].any() and bool((t[0] == 1.0).all()) and bool((t[3] == 1.0).all())
    t[2, :, :10] = 3.0  # writable again, from zero
    assert float(t[2].sum()) == 3.0 * 4 * 10 * 64


def test_release_leaves_other_tensors_alone() -> None:
    t = torch.ones(2, 2, 4096, 64)
    assert not reserve.mapped(t) and reserve.release(t, 0, 0, 4096) == 0
    assert bool((t == 1.0).all()) and reserve.resident_bytes(t) == t.numel() * 4
