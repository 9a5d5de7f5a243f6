"""CLI commands that run no model never import torch or transformers (they start fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import fleet_toml

HEAVY = ("torch", "transformers")

# Runs each command in turn in one interpreter and reports, after each, which heavy
# modules are loaded: the first command that pulls one in is named.
RUNNER = f"""
import json, sys
from batchfleet import cli

HEAVY = {HEAVY!r}
out = []
for argv in json.loads(sys.argv[1]):
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    out.append([rc, [m for m in HEAVY if m in sys.modules]])
print("RESULT " + json.dumps(out))
"""


def test_non_model_commands_leave_torch_and_transformers_unimported(
    redis_url: str, tmp_path: Path
) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(fleet_toml(redis_url, {"tiny": {"runner": "embedding", "path": "/nope"}}))
    url = ["--redis-url", redis_url]
    fast = ["--timeout", "0.2"]
    commands = [
        ["init-groups", "--config", str(fleet)],
        ["submit", "tiny", "hello", *url],
        ["status", *url, "--no-workers"],
        ["status", "--config", str(fleet), "--json"],
        ["pause", "tiny", *url, *fast],
        ["resume", *url, *fast, "-d", "nobody"],
        ["drain", "tiny", *url, *fast],
        ["policy", "tiny", "max_batch_size=4", *url, *fast],
        ["reset-prefix-cache", *url, *fast],
        ["dlq", "list", "tiny", *url, "--json"],
        ["dlq", "replay", "tiny", "--all", *url],
        ["dlq", "purge", "tiny", "--all", *url],
        ["trace", "tiny", "some-id", *url],
        ["webhooks", "list-failed", "--config", str(fleet)],
        ["webhooks", "redeliver", "--all", "--config", str(fleet)],
        ["simulate", "--requests", "200", "--rate", "100"],
        [
            "from-vllm",
            "--",
            "vllm",
            "serve",
            "/m/x",
            "--tool-call-parser",
            "hermes",
            "--speculative-config",
            '{"num_speculative_tokens": 2}',
            "--reasoning-parser",
            "qwen3",
        ],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    results = json.loads(line.removeprefix("RESULT "))
    assert len(results) == len(commands)
    for (rc, heavy), argv in zip(results, commands, strict=True):
        assert heavy == [], f"`batchfleet {' '.join(argv)}` imported {heavy}"
        assert rc in (0, 1), f"`batchfleet {' '.join(argv)}` exited {rc}: {proc.stderr[-2000:]}"


def test_status_top_and_flower_modules_are_light(redis_url: str) -> None:
    code = (
        "import sys, batchfleet.status, batchfleet.trace, batchfleet.remote, batchfleet.dlq;"
        # the webhooks worker and `celery -A batchfleet.worker.app control ...` load the app
        "import batchfleet.webhooks.worker, batchfleet.worker.app;"
        "assert batchfleet.remote.app.conf.broker_url.startswith('redis://');"  # Flower's app
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    env = dict(os.environ, REDIS_URL=redis_url)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "[]"
