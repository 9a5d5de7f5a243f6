"""Models whose layers do not all attend to the whole context (sliding windows, other
layer kinds) are served by transformers' paged engine, which follows their layer kinds;
the padded engine, which gives every layer the whole cache, refuses them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from batchfleet.worker.runners.gen_engine import why_windowed as _windowed
from batchfleet.worker.runners.generation import TextGenerationRunner
from devices import DEVICE
from test_generation_runner import Driver, prepare, req
from tiny_models import make_gpt_oss
from transformers import AutoModelForCausalLM, AutoTokenizer

OPTIONS = {"kv_cache_tokens": 1024, "page_size": 16, "step_tokens": 64, "max_running": 8}
PROMPTS = ["the man was", "a b c d e f g h i j k the man was there", "it"]


@pytest.mark.parametrize(
    ("config", "context", "why"),
    [
        ({}, 4096, None),  # Llama: no window
        ({"sliding_window": 4096}, 4096, None),  # Mistral: a window no shorter than the context
        ({"sliding_window": 4096}, 8192, "a sliding window of 4096 tokens"),
        ({"layer_types": ["full_attention"] * 2, "sliding_window": None}, 8192, None),  # Qwen2
        ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128},
         1024, "a sliding window of 128 tokens"),  # gpt-oss, Gemma
        ({"layer_types": ["linear_attention", "full_attention"]}, 1024, "linear_attention"),
    ],
)  # fmt: skip
def test_which_models_attend_to_the_whole_context(
    config: dict[str, object], context: int, why: str | None
) -> None:
    got = _windowed(SimpleNamespace(**config), context)
    assert got is None if why is None else got is not None and why in got


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpt_oss(tmp_path_factory.mktemp("gpt-oss"), window=8)


def _generate(path: Path, prompts: list[str], new: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        got = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
        out.append(got[0, ids.shape[1] :].tolist())
    return out


def _served(runner: TextGenerationRunner, prompts: list[str], new: int) -> list[list[int]]:
    preps = prepare(runner, *[req(f"r{i}", inputs=[p], max_new_tokens=new, ignore_eos=True,
                                  return_token_ids=True) for i, p in enumerate(prompts)])  # fmt: skip
    d = Driver(runner)
    d.step([(f"r{i}", p) for i, p in enumerate(preps)])
    d.run()
    return [d.finals[f"r{i}"].outputs[0]["token_ids"] for i in range(len(prompts))]


def test_a_sliding_window_model_is_served_by_the_paged_engine(gpt_oss: Path) -> None:
    # Given a model with a window of 8 tokens, shorter than its prompts and outputs
    runner = TextGenerationRunner(gpt_oss, device=DEVICE, dtype="float32", options=OPTIONS)
    assert runner.engine_kind == "paged"  # chosen for it
    # Then batched greedy tokens are generate's, one prompt at a time
    assert _served(runner, PROMPTS, 24) == _generate(gpt_oss, PROMPTS, 24)
    # and the prompt alone (max_new_tokens 0) is answered when admitted, as on any engine
    (prep,) = prepare(runner, req("z", inputs=PROMPTS, max_new_tokens=0, return_token_ids=True,
                                  return_prompt_text=True))  # fmt: skip
    d = Driver(runner)
    d.step([("z", prep)])
    tok = AutoTokenizer.from_pretrained(gpt_oss)
    assert [(o["prompt_token_ids"], o["prompt_text"], o["completion_tokens"])
            for o in d.finals["z"].outputs] == [(tok(p).input_ids, p, 0) for p in PROMPTS]  # fmt: skip


def test_the_padded_engine_refuses_a_sliding_window_model(gpt_oss: Path) -> None:
    with pytest.raises(ValueError, match="sliding window of 8 tokens"):
        TextGenerationRunner(gpt_oss, device=DEVICE, dtype="float32",
                             options={**OPTIONS, "engine": "padded"})  # fmt: skip


def test_a_window_as_long_as_the_context_is_the_padded_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = make_gpt_oss(tmp_path_factory.mktemp("gpt-oss-wide"), window=1024, context=1024)
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32", options=OPTIONS)
    assert runner.engine_kind == "padded"
    assert _served(runner, PROMPTS, 16) == _generate(path, PROMPTS, 16)
