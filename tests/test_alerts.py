"""/metrics series exist from the start, and the Prometheus alerting rules in deploy/prometheus
query only exported series, pass ``promtool check rules`` and their ``promtool test rules``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import redis
import yaml
from batchfleet.producer.gateway.metrics import GatewayMetrics
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.keys import ModelKeys
from batchfleet.worker.metrics import Metrics, StreamCollector
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

PROMETHEUS = Path(__file__).parents[1] / "deploy" / "prometheus"
RULES = PROMETHEUS / "alerts.yml"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def registry(r: redis.Redis) -> CollectorRegistry:
    """A worker's registry for model ``tiny`` (2 lanes), its queue gauges read from ``r``."""
    reg = CollectorRegistry()
    Metrics(reg).init_model("tiny", 2)
    reg.register(StreamCollector(r, {"tiny": 2}))
    return reg


def test_counters_exist_at_zero_before_their_first_event(registry: CollectorRegistry) -> None:
    samples = scrape(registry)
    assert samples[("batchfleet_out_of_memory_total", (("model", "tiny"),))] == 0
    for code in ErrorCode:
        labels = (("code", code.value), ("model", "tiny"))
        assert samples[("batchfleet_dead_letters_total", labels)] == 0
        assert samples[("batchfleet_errors_total", labels)] == 0
    for lane in ("0", "1"):
        for status in ("ok", "error", "expired"):
            labels = (("lane", lane), ("model", "tiny"), ("status", status))
            assert samples[("batchfleet_results_total", labels)] == 0


def test_dead_letter_stream_length_gauge(r: redis.Redis, registry: CollectorRegistry) -> None:
    key = ("batchfleet_dead_letter_stream_length", (("model", "tiny"),))
    assert scrape(registry)[key] == 0
    for i in range(3):
        r.xadd(ModelKeys("tiny").dead, {"code": "malformed", "n": str(i)})
    assert scrape(registry)[key] == 3


def test_rules_query_only_exported_series(registry: CollectorRegistry) -> None:
    gateway = GatewayMetrics()
    gateway.watch(lambda: 0, lambda: 1)
    gateway.ended("/v1/completions", "POST", 200, 0.1)  # a labelled series is exported once used
    exported = {name for name, _ in scrape(registry)} | {
        name for name, _ in scrape(gateway.registry)
    }
    exported |= {name.removesuffix("_total") for name in exported}  # counters by either name
    rules = yaml.safe_load(RULES.read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    used = {name for expr in exprs for name in re.findall(r"\bbatchfleet_[a-z_]+", expr)}
    assert len(exprs) >= 6 and used
    assert used <= exported, used - exported
    prom = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert RULES.name in prom["rule_files"]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not found (Debian's prometheus package has it; CI installs it)")
    return subprocess.run(
        [tool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120
    )


def test_promtool_check_rules() -> None:
    out = promtool("check", "rules", RULES.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 9 rules found" in out.stdout


def test_promtool_unit_tests_of_the_rules() -> None:
    out = promtool("test", "rules", "alerts.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
