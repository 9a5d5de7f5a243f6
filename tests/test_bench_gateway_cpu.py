"""The gateway CPU benchmark runs end to end (a few tokens, every route, the profile).

Not a benchmark: it asserts that every stream is answered and a report is written, never
a time (see bench/gateway_cpu.py for the numbers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gateway_cpu import ROUTES, main


@pytest.mark.timeout(120)
def test_every_route_streams_and_is_reported_with_a_profile(tmp_path: Path) -> None:
    main(["--requests", "2", "--tokens", "3", "--rounds", "1", "--profile",
          "--out", str(tmp_path)])  # fmt: skip
    report = (tmp_path / "report.md").read_text()
    assert all(f"| {route} |" in report for route in ROUTES)
    assert "producer/gateway/generate.py" in (tmp_path / "profile.txt").read_text()
