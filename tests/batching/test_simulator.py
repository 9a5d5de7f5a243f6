"""The simulator and its CLI: accounting, reproducibility, the issue's headline behaviour."""

from __future__ import annotations

import pytest
from batchfleet.batching import simulate_cli
from batchfleet.batching.simulator import LinearCost, simulate
from batchfleet.batching.traces import bursts, merge, poisson
from batchfleet.batching.types import Policy


def test_accounts_for_every_request_across_workers() -> None:
    trace = merge(
        poisson(3000, 900.0, lanes=(0.6, 0.3, 0.1), deadline_ms=300, seed=1),
        bursts(1000, 50.0, 3000.0, seed=2),
    )
    report = simulate(trace, Policy(), LinearCost(jitter=0.2), workers=3, seed=1)
    assert report.stuck == 0
    assert report.completed + report.expired == len(trace)
    assert sum(r.completed for r in report.lanes) == report.completed
    assert max(report.batch_rows) <= 32


def test_reproducible() -> None:
    trace = poisson(2000, 400.0, seed=3)
    first = simulate(trace, Policy(), LinearCost(jitter=0.1), seed=7)
    again = simulate(trace, Policy(), LinearCost(jitter=0.1), seed=7)
    assert first == again


def test_low_load_pays_no_window() -> None:
    report = simulate(poisson(500, 5.0, tokens=16, seed=4), Policy(max_wait_ms=20), LinearCost())
    assert report.latency_p50 == pytest.approx(0.021, abs=0.0005)
    fixed = simulate(
        poisson(500, 5.0, tokens=16, seed=4), Policy(max_wait_ms=20, adaptive=False), LinearCost()
    )
    assert fixed.latency_p50 == pytest.approx(0.041, abs=0.0005)


def test_saturation_runs_full_batches() -> None:
    cost = LinearCost()
    report = simulate(poisson(6000, 2 * cost.limit(32), tokens=16, seed=5), Policy(), cost)
    assert report.throughput >= 0.97 * cost.limit(32)


def test_out_of_memory_backs_off() -> None:
    report = simulate(
        poisson(3000, 2000.0, tokens=40, seed=6), Policy(), LinearCost(), memory_tokens=800
    )
    assert report.ooms >= 1
    assert report.stuck == 0 and report.completed == 3000
    assert report.ooms < 20  # it learnt, rather than failing every big batch


def test_cli_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = simulate_cli.main(
        ["-n", "2000", "--rate", "300", "--lanes", "0.7,0.3", "--workers", "2"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "throughput" in out and "lat p99" in out and "reasons:" in out


def test_cli_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_cli.main(["--rate", "0"]) == 2
