"""A model's sampling defaults (vLLM's ``--generation-config`` and
``--override-generation-config``): the fields a request leaves unset take those of the
model's ``generation_config.json`` (``auto``, or a folder) with the operator's override over
them; explicit fields win; ``vllm`` (the default) takes none; beam search takes only the
defaults it takes; model info and the Responses API's echo show them."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import WorkerProcess, fleet_toml
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.producer.gateway.endpoint import Answered  # noqa: E402
from batchfleet.producer.gateway.responses import echoed, settings  # noqa: E402
from batchfleet.schemas.keys import ModelKeys  # noqa: E402
from batchfleet.schemas.messages import Limits  # noqa: E402
from batchfleet.schemas.model_info import ModelInfo  # noqa: E402
from batchfleet.worker.generation import defaults  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling  # noqa: E402
from batchfleet.worker.runner import PrepareError  # noqa: E402
from batchfleet.worker.runner_info import model_info  # noqa: E402
from batchfleet.worker.runners.generation import GenSpec, TextGenerationRunner  # noqa: E402
from test_gateway_replies import Worker  # noqa: E402
from test_gateway_responses import posted  # noqa: E402
from test_generation_e2e import MODEL, result, submit  # noqa: E402
from test_generation_runner import greedy, prepare, req, run  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

FILE = {"do_sample": False, "temperature": 1.5, "top_p": 0.95, "top_k": 40, "min_p": 0.01,
        "repetition_penalty": 1.1, "max_new_tokens": 9}  # fmt: skip
"""The model author's sampling: vLLM takes it whatever ``do_sample`` says."""
EXPLICIT = {"temperature": 1.5, "top_p": 0.95, "top_k": 40, "min_p": 0.01,
            "repetition_penalty": 1.1, "max_new_tokens": 9}  # fmt: skip
"""The same, as a request's own fields."""
OPTS = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 16}


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, its generation_config.json carrying the author's sampling."""
    path = make_causal_lm(tmp_path_factory.mktemp("lm"))
    cfg = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(cfg | FILE))
    return path


def runner(path: Path, engine: str = "padded", **opts: Any) -> TextGenerationRunner:
    return TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                options=OPTS | {"engine": engine} | opts)  # fmt: skip


def spec_of(r: TextGenerationRunner, **kw: Any) -> GenSpec:
    (p,) = prepare(r, req("x", **kw))
    assert isinstance(p.payload, GenSpec)
    return p.payload


def test_auto_takes_the_file_s_sampling_for_fields_left_unset(lm_dir: Path) -> None:
    s = spec_of(runner(lm_dir, generation_config="auto"), seed=3, n=2)
    assert (s.sampling.temperature, s.sampling.top_p, s.sampling.top_k) == (1.5, 0.95, 40)
    assert (s.sampling.min_p, s.sampling.repetition_penalty) == (0.01, 1.1)
    assert s.max_new_tokens == (9,) and s.sampling_of(1).temperature == 1.5  # n: each
    assert s.sampling.seed == 3


@pytest.mark.parametrize("engine", ["padded", "paged"])
def test_a_request_without_fields_samples_as_one_with_the_file_s_fields(
    lm_dir: Path, engine: str
) -> None:
    auto = runner(lm_dir, engine, generation_config="auto")
    plain = runner(lm_dir, engine)  # "vllm": greedy, the protocol's default
    (out,) = run(auto, req("a", seed=11, return_token_ids=True))["a"]
    (same,) = run(plain, req("b", seed=11, return_token_ids=True, **EXPLICIT))["b"]
    assert out["token_ids"] == same["token_ids"] and len(out["token_ids"]) <= 9
    assert out["text"] != greedy(auto, "the man was", 9)


def test_explicit_fields_win_temperature_zero_included(lm_dir: Path) -> None:
    r = runner(lm_dir, generation_config="auto")
    s = spec_of(r, temperature=0.0, top_k=5, max_new_tokens=3)
    assert (s.sampling.temperature, s.sampling.top_k, s.max_new_tokens) == (0.0, 5, (3,))
    assert s.sampling.top_p == 0.95  # the fields it left unset: the model's
    (out,) = run(r, req("g", temperature=0.0, max_new_tokens=6))["g"]
    assert out["text"] == greedy(r, "the man was", 6)


def test_vllm_the_default_ignores_the_file(lm_dir: Path) -> None:
    for r in (runner(lm_dir), runner(lm_dir, generation_config="vllm")):
        s = spec_of(r)
        assert s.sampling == Sampling() and s.max_new_tokens == (256,)
        assert r.sampling_defaults.values == {}


def test_a_folder_s_file_and_the_override_over_it(lm_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(lm_dir, bare)
    (bare / "generation_config.json").unlink()
    assert runner(bare, generation_config="auto").sampling_defaults.values == {}
    r = runner(bare, generation_config=str(lm_dir),
               override_generation_config={"temperature": 0.3, "min_p": 0.2})  # fmt: skip
    s = spec_of(r)
    assert (s.sampling.temperature, s.sampling.min_p, s.sampling.top_p) == (0.3, 0.2, 0.95)
    # the override alone, over "vllm"'s none; options.max_new_tokens over the file's
    r = runner(lm_dir, override_generation_config={"top_k": 7})
    assert spec_of(r).sampling == Sampling(top_k=7)
    assert runner(lm_dir, generation_config="auto", max_new_tokens=4).default_new_tokens == 4


@pytest.mark.parametrize(("source", "override", "cap"), [
    ("auto", None, None),  # the file's 9: a default only (vLLM #34063)
    ("vllm", None, None),
    ("auto", {"max_new_tokens": 5}, 5),  # the override's bounds every request
    ("vllm", {"max_new_tokens": 5}, 5),
    ("auto", {"temperature": 0.5}, None),
    ("folder", None, 9),  # a folder's file's bounds them too (vLLM's override_max_tokens)
    ("folder", {"max_new_tokens": 12}, 12),  # the override's over it
])  # fmt: skip
def test_which_max_new_tokens_bounds_an_explicit_one(
    lm_dir: Path, source: str, override: dict[str, Any] | None, cap: int | None
) -> None:
    got = defaults.load(lm_dir, str(lm_dir) if source == "folder" else source, override)
    assert got.cap == cap


def test_the_bound_cuts_a_request_s_own_max_new_tokens(lm_dir: Path) -> None:
    # auto: the file's max_new_tokens (9) is the default, an explicit one goes past it
    auto = runner(lm_dir, generation_config="auto")
    assert spec_of(auto).max_new_tokens == (9,)
    assert spec_of(auto, max_new_tokens=20).max_new_tokens == (20,)
    # the override's bounds them all (the default, an explicit one, a beam search's)
    for source in ("auto", "vllm"):
        capped = runner(lm_dir, generation_config=source,
                        override_generation_config={"max_new_tokens": 5})  # fmt: skip
        assert [spec_of(capped, **kw).max_new_tokens for kw in (
            {}, {"max_new_tokens": 20}, {"max_new_tokens": 3},
            {"max_new_tokens": 20, "use_beam_search": True})] == [(5,), (5,), (3,), (5,)]  # fmt: skip
        (out,) = run(capped, req("c", max_new_tokens=20, ignore_eos=True))["c"]
        assert (out["completion_tokens"], out["finish_reason"]) == (5, "length")
        # min_new_tokens past the bound is refused, as vLLM's min_tokens > max_tokens
        (bad,) = capped.prepare_many([req("m", max_new_tokens=20, min_new_tokens=8)])
        assert isinstance(bad, PrepareError) and "min_new_tokens 8 > max_new_tokens 5" in str(bad)
    # a folder's file's bounds them, and the option's default too
    folder = runner(lm_dir, generation_config=str(lm_dir), max_new_tokens=30)
    assert folder.default_new_tokens == 9
    assert spec_of(folder, max_new_tokens=20).max_new_tokens == (9,)


@pytest.mark.parametrize(("opts", "words"), [
    ({"override_generation_config": {"temprature": 0.5}}, "temprature not taken (vLLM's keys: "
     "repetition_penalty, temperature, top_k, top_p, min_p, max_new_tokens)"),
    ({"override_generation_config": {"top_p": 0}}, "top_p: Input should be greater than 0"),
    ({"override_generation_config": {"max_new_tokens": 0}}, "max_new_tokens at least 1"),
    ({"override_generation_config": [0.5]}, "a table of"),
    ({"generation_config": "/nowhere"}, "/nowhere holds no generation_config.json"),
    ({"generation_config": 1}, "is not 'auto', 'vllm' or a folder"),
    ({"max_new_tokens": 5, "override_generation_config": {"max_new_tokens": 6}}, "set one"),
])  # fmt: skip
def test_bad_options_are_refused_at_load(lm_dir: Path, opts: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as err:
        runner(lm_dir, **opts)
    assert words in str(err.value)


def test_a_bad_value_in_the_file_is_refused_at_load(tmp_path: Path, lm_dir: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": -2}))
    with pytest.raises(ValueError, match=r"generation_config\.json: top_k"):
        runner(lm_dir, generation_config=str(tmp_path))
    # vLLM's -1 (no limit) is the protocol's 0
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": -1, "top_p": 0.5}))
    assert defaults.load(lm_dir, str(tmp_path)).values == {"top_k": 0, "top_p": 0.5}


def test_beam_search_takes_only_the_defaults_it_takes(lm_dir: Path) -> None:
    """vLLM's beam search takes temperature and max_tokens: the file's top_p, top_k,
    min_p and repetition_penalty are not applied, and do not refuse it."""
    r = runner(lm_dir, generation_config="auto")
    s = spec_of(r, use_beam_search=True, n=2, seed=4)
    assert s.beam and s.max_new_tokens == (9,)
    assert s.sampling == Sampling(temperature=1.5, seed=4)
    plain = runner(lm_dir)
    got = run(r, req("b", use_beam_search=True, n=2, seed=4))["b"]
    want = run(plain, req("c", use_beam_search=True, n=2, seed=4, temperature=1.5,
                          max_new_tokens=9))["c"]  # fmt: skip
    assert [o["text"] for o in got] == [o["text"] for o in want]


def test_model_info_shows_them_and_the_responses_api_echoes_them(lm_dir: Path) -> None:
    r = runner(lm_dir, generation_config="auto", override_generation_config={"top_p": 0.8})
    info = model_info(r, Limits(), 1)
    assert info.sampling_defaults == {"temperature": 1.5, "top_p": 0.8, "top_k": 40,
                                      "min_p": 0.01, "repetition_penalty": 1.1}  # fmt: skip
    assert info.default_max_new_tokens == 9
    assert r.info()["sampling_defaults"] == info.sampling_defaults
    answered = Answered("resp_1", 5, sampling=info.sampling_defaults)
    body: dict[str, Any] = {"input": "hi"}
    got = settings(body, answered, "m")
    assert (got["temperature"], got["top_p"]) == (1.5, 0.8)
    got = settings(body | {"temperature": 0.0, "top_p": 0.5}, answered, "m")
    assert (got["temperature"], got["top_p"]) == (0.0, 0.5)
    assert echoed(settings(body, answered, "m")).sampling == {"temperature": 1.5, "top_p": 0.8}
    bare = settings(body, Answered("resp_2", 5), "m")  # no defaults published: greedy
    assert (bare["temperature"], bare["top_p"]) == (0.0, 1.0)


def test_a_gguf_file_carries_no_defaults_for_auto(lm_dir: Path) -> None:
    """vLLM reads a generation config from a GGUF file's own metadata only, which holds
    no sampling: ``auto`` applies none there (the folder's file is another model's)."""
    assert defaults.load(lm_dir, "auto", None, gguf_file="m.gguf").values == {}
    assert defaults.load(lm_dir, "auto", {"top_k": 3}, gguf_file="m.gguf").values == {"top_k": 3}
    assert defaults.load(lm_dir, "auto").values == {k: v for k, v in FILE.items()
                                                    if k != "do_sample"}  # fmt: skip


@pytest.mark.timeout(180)
def test_a_direct_redis_client_s_request_takes_them_in_a_worker(
    redis_url: str, r: Any, lm_dir: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    """Through a real worker, a bare msgpack request on the lane stream: no gateway."""
    # Given a worker whose model takes its generation_config.json (and publishes them)
    text = fleet_toml(redis_url, {MODEL: {"runner": "text-generation", "path": str(lm_dir),
                                          "options": OPTS | {"generation_config": "auto"}}})  # fmt: skip
    start_worker(text, "gen-defaults").wait_ready(r, MODEL)
    info = json.loads(r.get(ModelKeys(MODEL).info))
    assert info["sampling_defaults"]["temperature"] == 1.5
    # When a request sets nothing, and another sets the file's fields itself
    plain = submit(r, inputs=["the man was"], seed=11, return_token_ids=True)
    given = submit(r, inputs=["the man was"], seed=11, return_token_ids=True, **EXPLICIT)
    greedy_ = submit(r, inputs=["the man was"], temperature=0, return_token_ids=True)
    # Then both sample the same tokens, up to the file's max_new_tokens; temperature 0 not
    (a,), (b,), (g,) = (result(r, rid)["outputs"] for rid in (plain, given, greedy_))
    assert a["token_ids"] == b["token_ids"] and a["completion_tokens"] <= 9
    assert a["token_ids"] != g["token_ids"]


def test_the_gateway_echoes_the_published_defaults(redis_url: str, r: Any) -> None:
    """A Responses API answer to a body without temperature or top_p echoes those the
    model's workers published (its workers here: the test writes their info and result)."""
    keys = ModelKeys("m")
    r.set(keys.lanes_key, 3)
    published = ModelInfo(task="text-generation", sampling_defaults={"temperature": 0.6,
                                                                     "top_p": 0.95, "top_k": 20})  # fmt: skip
    r.set(keys.info, published.model_dump_json())

    async def go(body: dict[str, Any], rid: str) -> dict[str, Any]:
        async with posted(redis_url, {"model": "m", "input": "x"} | body, rid) as (channel, reader):
            Worker(r, channel, rid).finish("hi", 1)
            answer = await reader.read()
        out: dict[str, Any] = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        return out

    got = asyncio.run(go({}, "rq-1"))
    assert (got["status"], got["temperature"], got["top_p"]) == ("completed", 0.6, 0.95)
    got = asyncio.run(go({"temperature": 0, "top_p": 0.5}, "rq-2"))
    assert (got["temperature"], got["top_p"]) == (0, 0.5)
