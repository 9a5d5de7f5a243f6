"""Token ids in and out (vLLM's ``TokensPrompt`` and ``return_token_ids``): a prompt sent
as ``{"prompt_token_ids": [...]}`` is taken as it is, and ``return_token_ids`` gives each
output its generated ``token_ids`` (the first of each input its ``prompt_token_ids``) and
each delta its own, so a client (an RL trainer) goes on from exactly the tokens, with no
tokenizing again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE
from pydantic import ValidationError

torch = pytest.importorskip("torch")

from batchfleet.schemas.errors import ErrorCode  # noqa: E402
from batchfleet.schemas.inputs import TokenPrompt  # noqa: E402
from batchfleet.schemas.messages import Request  # noqa: E402
from batchfleet.worker.runner import Prepared, PrepareError  # noqa: E402
from batchfleet.worker.runners.embedding import EmbeddingRunner  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_runner import Driver, prepare, run  # noqa: E402

PROMPT = "the man was"


@pytest.fixture(scope="module", params=["padded", "paged"])
def runner(tiny_lm: Path, request: pytest.FixtureRequest) -> TextGenerationRunner:
    return TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, "engine": request.param})  # fmt: skip


def req(rid: str, **kw: Any) -> Request:
    kw.setdefault("inputs", [PROMPT])
    return Request(id=rid, model="lm", **kw)


def test_a_prompt_of_token_ids_is_taken_as_it_is(runner: TextGenerationRunner) -> None:
    ids = runner.tokenizer(PROMPT)["input_ids"]
    # a token sequence the tokenizer would not write for any text (its last token twice,
    # no BOS) is kept: the prompt is not decoded and tokenized again
    odd = ids[1:] + ids[-1:]
    outs = run(runner, req("text", max_new_tokens=8),
               req("ids", inputs=[{"prompt_token_ids": ids}], max_new_tokens=8),
               req("odd", inputs=[TokenPrompt(prompt_token_ids=odd)], max_new_tokens=8,
                   return_token_ids=True))  # fmt: skip
    # the same tokens, the same greedy text (the second took the first's prefill, so its
    # cached_tokens differ)
    for a, b in zip(outs["ids"], outs["text"], strict=True):
        assert {**a, "cached_tokens": 0} == {**b, "cached_tokens": 0}
    (odd_out,) = outs["odd"]
    assert odd_out["prompt_token_ids"] == odd and odd_out["prompt_tokens"] == len(odd)
    expected = runner.model.generate(torch.tensor([odd], device=runner.torch_device),
                                     max_new_tokens=8, do_sample=False,
                                     pad_token_id=runner.eos[0])[0, len(odd) :].tolist()  # fmt: skip
    assert odd_out["token_ids"] == expected[: len(odd_out["token_ids"])]


def test_return_token_ids_in_outputs_and_deltas(runner: TextGenerationRunner) -> None:
    (prep,) = prepare(runner, req("s", max_new_tokens=12, n=2, seed=3, temperature=1.0,
                                  stream=True, return_token_ids=True, logprobs=0))  # fmt: skip
    d = Driver(runner)
    d.step([("s", prep)])
    d.run()
    first, second = d.finals["s"].outputs
    prompt = runner.tokenizer(PROMPT)["input_ids"]
    assert first["prompt_token_ids"] == prompt and "prompt_token_ids" not in second
    for i, out in enumerate((first, second)):
        ids = out["token_ids"]
        assert len(ids) == out["completion_tokens"] == len(out["logprobs"])
        assert ids == [lp["token"] for lp in out["logprobs"]]
        assert out["text"] == runner.tokenizer.decode(ids, skip_special_tokens=True)
        chunks = [c for c in d.partials["s"] if c["input"] == i]
        assert [t for c in chunks for t in c["token_ids"]] == ids
        assert all(len(c["token_ids"]) == c["tokens"] for c in chunks)
    # without it, none
    (plain,) = run(runner, req("p", max_new_tokens=4))["p"]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_going_on_from_the_returned_tokens_continues_the_greedy_text(
    runner: TextGenerationRunner,
) -> None:
    (whole,) = run(runner, req("w", max_new_tokens=10, return_token_ids=True))["w"]
    (head,) = run(runner, req("h", max_new_tokens=4, return_token_ids=True))["h"]
    again = head["prompt_token_ids"] + head["token_ids"]
    (tail,) = run(runner, req("t", inputs=[{"prompt_token_ids": again}], max_new_tokens=6,
                              return_token_ids=True))["t"]  # fmt: skip
    assert head["token_ids"] + tail["token_ids"] == whole["token_ids"]


def test_token_prompts_out_of_bounds_are_refused(
    runner: TextGenerationRunner, tiny_embedder: Path
) -> None:
    # not tokens of this model: invalid_input, when read
    (bad,) = runner.prepare_many([req("v", inputs=[{"prompt_token_ids": [5, runner.vocab_size]}])])
    assert isinstance(bad, PrepareError) and bad.code is ErrorCode.INVALID_INPUT
    assert f"{runner.vocab_size} is not a token" in str(bad)
    # the wire's bounds: ids are ints from 0 to 2**31 - 1, at least one, at most
    # max_text_chars
    for ids, why in (([], "empty_input"), ([-1], "greater than or equal"),
                     ([2**31], "less than"), (["5"], "valid integer"),
                     ([True], "valid integer"), ([1.0], "valid integer"),
                     ([1] * 100_001, "too_large")):  # fmt: skip
        with pytest.raises(ValidationError, match=why):
            req("b", inputs=[{"prompt_token_ids": ids}])
    # a model that does not generate takes none
    embedder = EmbeddingRunner(tiny_embedder, device=DEVICE, dtype="float32", max_tokens=32)
    (refused,) = embedder.prepare_many([req("e", inputs=[{"prompt_token_ids": [5]}])])
    assert isinstance(refused, PrepareError) and refused.code is ErrorCode.INVALID_INPUT
    assert "is of kind tokens" in str(refused)
    ok = runner.prepare_many([req("k", inputs=["text", {"prompt_token_ids": [5, 6]}])])
    assert all(isinstance(p, Prepared) for p in ok)
