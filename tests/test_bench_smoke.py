"""The benchmark harness runs end to end (``--quick``, no-op model, tiny counts).

Not a benchmark: it asserts that every request is answered and a report is written,
never a time (see bench/ for the numbers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("celery_batches", reason="pip install 'batchfleet[bench]'")
pytest.importorskip("matplotlib", reason="pip install 'batchfleet[bench]'")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import main


@pytest.mark.timeout(120)
def test_quick_noop_run_writes_a_report(tmp_path: Path) -> None:
    # Given the quick mode on the no-op model, scaled down to a few dozen requests
    code = main(["--quick", "--models", "noop", "--scale", "0.05", "--drain-s", "20",
                 "--out", str(tmp_path), "--name", "smoke"])  # fmt: skip

    # Then every system answered every request, and the report has its tables and plots
    assert code == 0
    report = (tmp_path / "smoke.md").read_text()
    for system in ("batchfleet", "batchfleet-fixed", "celery", "celery-batches"):
        assert f"| {system} |" in report
    header = next(line.split("|") for line in report.splitlines() if "| lost |" in line)
    lost = [c.strip() for c in header].index("lost")
    rows = [line.split("|") for line in report.splitlines()
            if line.startswith("| batchfleet") and len(line.split("|")) == len(header)]  # fmt: skip
    assert rows and all(cells[lost].strip() == "0" for cells in rows), "none lost"
    assert (tmp_path / "smoke-noop-latency.png").stat().st_size > 0
    assert (tmp_path / "smoke-noop-lanes.png").stat().st_size > 0
