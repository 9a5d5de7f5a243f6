"""The device the runner tests use: ``cpu``, or ``BATCHFLEET_TEST_DEVICE`` (``cuda`` on a
GPU machine, as ``bench/gpu_check.sh`` runs them)."""

from __future__ import annotations

import os

DEVICE = os.environ.get("BATCHFLEET_TEST_DEVICE", "cpu")
