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
@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_quick_generation_run_writes_a_report(tmp_path: Path, precision: str) -> None:
    # Given the quick mode on the random Llama, a few short requests
    code = main(["--quick", "--models", "tiny", "--requests", "4", "--unloaded", "2",
                 "--max-new", "12", "--max-prompt", "48", "--no-profile", "--drain-s", "60",
                 "--out", str(tmp_path), "--name", "smoke", "--matmul-precision", precision])  # fmt: skip

    # Then a report with the targets and every system's row is written
    assert code == 0
    report = (tmp_path / "smoke.md").read_text()
    assert "## Targets" in report
    if precision == "medium":  # every arm's runner option; the baselines in float32 too
        assert "matmul_precision = medium" in report
        assert "| static batching, matmul_precision highest |" in report
        assert "| one at a time, matmul_precision highest |" in report
    else:  # the default, left out of the options (workers before it refuse it)
        assert "matmul_precision" not in report.split("## Method")[0]
    for system in ("engine alone", "static batching", "one at a time", "fleet unloaded",
                   "fleet saturated", "fleet, lane-0 probes over saturation",
                   "engine alone, again"):  # fmt: skip
        assert f"| {system} |" in report


def test_runs_that_lost_cpu_to_steal_are_flagged_under_the_targets(tmp_path: Path) -> None:
    from bench.generation import GenModel, Job, ModelResult, Outcome, targets

    jobs = [Job(0, 0.0, 0, "hi", (1, 2), 4)]

    def run(system: str, tokens: int, steal: float) -> Outcome:
        o = Outcome.empty(system, 1.0, jobs, [0.0])
        o.start[0], o.done[0], o.tokens[0], o.extra["steal"] = 0.0, 2.0, tokens, steal
        return o

    result = ModelResult(GenModel("m", tmp_path, {}))
    result.outcomes = {"engine alone": run("engine alone", 100, 0.01),
                       "fleet saturated": run("fleet saturated", 90, 0.12)}  # fmt: skip
    lines = targets([result])
    assert any("fleet ≥ 90% of engine alone" in line and "**90%**" in line for line in lines)
    assert "CPU steal of 5% or more** during: m fleet saturated (12%)" in lines[-1]
    result.outcomes["fleet saturated"].extra["steal"] = 0.02
    assert not any("CPU steal" in line for line in targets([result]))
