"""``python -m bench.multimodal --quick`` runs end to end and writes its table.

Not a benchmark: it asserts that every measurement is there (every request was answered
``ok``, or the run fails), never a time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.multimodal import main


@pytest.mark.timeout(300)
def test_quick_multimodal_run_writes_its_table(tmp_path: Path) -> None:
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("*-multimodal.md")
    rows = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].split(",")[0].strip() for r in rows[2:]] == [
        "ViT", "SigLIP 2 native resolution", "forward s", "Reranker",
    ]  # fmt: skip
