"""The generation benchmark runs end to end (``--quick``, the random Llama, tiny counts).

Not a benchmark: it asserts that a report is written, never a time (see
``bench/generation.py`` for the numbers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generation import main


@pytest.mark.timeout(240)
def test_quick_generation_run_writes_a_report(tmp_path: Path) -> None:
    # Given the quick mode on the random Llama, a few short requests
    code = main(["--quick", "--models", "tiny", "--requests", "4", "--unloaded", "2",
                 "--max-new", "12", "--max-prompt", "48", "--no-profile", "--drain-s", "60",
                 "--out", str(tmp_path), "--name", "smoke"])  # fmt: skip

    # Then a report with the targets and every system's row is written
    assert code == 0
    report = (tmp_path / "smoke.md").read_text()
    assert "## Targets" in report
    for system in ("engine alone", "static batching", "one at a time", "fleet unloaded",
                   "fleet saturated", "fleet, lane-0 probes over saturation",
                   "engine alone, again"):  # fmt: skip
        assert f"| {system} |" in report
