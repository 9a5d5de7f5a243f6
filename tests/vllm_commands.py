"""``batchfleet from-vllm`` run as the tests run it: into a file, read back with tomllib and
loaded by the fleet loader, as ``batchfleet worker --config`` would load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from batchfleet.config import load_config
from batchfleet.from_vllm import from_vllm


def run(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None,
        keep_going: bool = False) -> tuple[int, dict[str, Any], str, str]:  # fmt: skip
    """from-vllm into a file: exit code, the file as TOML (and loaded by the fleet loader),
    the gateway command's argv after ``batchfleet``, stderr."""
    out = tmp_path / "fleet.toml"
    code, stdout, stderr = from_vllm(argv, out=str(out), keep_going=keep_going, env=env or {})
    if code:
        return code, {}, "", stderr
    load_config(out)  # as `batchfleet worker --config` would
    gateway = next(ln for ln in stdout.splitlines() if ln.startswith("batchfleet gateway"))
    return code, tomllib.loads(out.read_text()), gateway, stderr


def started_runner(tmp_path: Path, argv: list[str], name: str) -> tuple[Any, Any]:
    """from-vllm into a file, and model ``name``'s runner started from it on the CPU (as a
    worker starts it): the runner and the model's settings."""
    code, _, _, stderr = run(tmp_path, argv)
    assert code == 0, stderr
    from batchfleet.worker.runners import resolve

    cfg = load_config(tmp_path / "fleet.toml").models[name]
    runner = resolve(cfg.runner)(cfg.resolved_path(), device="cpu", dtype=cfg.dtype,
                                 max_tokens=cfg.max_tokens, options=cfg.options)  # fmt: skip
    return runner, cfg
