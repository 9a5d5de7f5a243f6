"""``options.seed`` (vLLM's ``--seed``): sampled requests without a seed of their own draw
from the seed's stream, so two fresh workers with the same seed sample the same tokens for
the same unseeded requests, another seed samples others, a restart starts the stream
over, and requests with their own seed are untouched; on both engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from batchfleet.worker.runners.generation import TextGenerationRunner
from devices import DEVICE
from test_generation_runner import PROMPTS, Driver, prepare, req
from tiny_models import make_causal_lm


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture(params=["padded", "paged"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def fresh(lm_dir: Path, engine: str, seed: int | None) -> TextGenerationRunner:
    opts: dict[str, Any] = {"kv_cache_tokens": 1024, "page_size": 16, "step_tokens": 64,
                            "max_running": 8, "engine": engine}  # fmt: skip
    if seed is not None:
        opts["seed"] = seed
    return TextGenerationRunner(lm_dir, device=DEVICE, dtype="float32", options=opts)


def texts(runner: TextGenerationRunner, **kw: Any) -> dict[str, str]:
    """Three sampled requests (``kw``: their own fields), admitted one step apart, run to
    their ends: each one's text."""
    reqs = [req(f"r{i}", inputs=[PROMPTS[i]], max_new_tokens=10, temperature=1.5, **kw)
            for i in range(3)]  # fmt: skip
    d = Driver(runner)
    for r, p in zip(reqs, prepare(runner, *reqs), strict=True):
        d.step([(r.id, p)])
    d.run()
    return {k: str(f.outputs[0]["text"]) for k, f in d.finals.items()}


def test_two_fresh_workers_with_one_seed_sample_alike_and_another_seed_differs(
    lm_dir: Path, engine: str
) -> None:
    a = texts(fresh(lm_dir, engine, 5))
    assert texts(fresh(lm_dir, engine, 5)) == a
    other = texts(fresh(lm_dir, engine, 6))
    assert all(other[k] != a[k] for k in a)  # each request's own draws moved
    # without the option every request takes a random seed (none of 63 bits repeats)
    assert texts(fresh(lm_dir, engine, None)) != texts(fresh(lm_dir, engine, None))


def test_the_stream_goes_on_across_requests_and_starts_over_after_a_restart(
    lm_dir: Path, engine: str
) -> None:
    runner = fresh(lm_dir, engine, 5)
    first = texts(runner)
    assert texts(runner) != first  # the next requests take the stream's next seeds
    runner.forget_all()  # the loop crashed: it starts over as a fresh worker
    assert texts(runner) == first


def test_requests_with_their_own_seed_ignore_the_workers(lm_dir: Path, engine: str) -> None:
    own = texts(fresh(lm_dir, engine, None), seed=11)
    assert texts(fresh(lm_dir, engine, 5), seed=11) == own
    assert texts(fresh(lm_dir, engine, 6), seed=11) == own


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, "7", True])
def test_a_seed_that_is_not_a_63_bit_integer_is_refused(lm_dir: Path, bad: object) -> None:
    with pytest.raises(ValueError, match=r"options\.seed"):
        TextGenerationRunner(lm_dir, device=DEVICE, dtype="float32",
                             options={"kv_cache_tokens": 256, "seed": bad})  # fmt: skip
