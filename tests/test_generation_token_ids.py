"""Token ids in and out (vLLM's ``TokensPrompt`` and ``return_token_ids``): a prompt sent
as ``{"prompt_token_ids": [...]}`` is taken as it is, and ``return_token_ids`` gives each
output its generated ``token_ids`` (the first of each input its ``prompt_token_ids``) and
each delta its own, so a client (an RL trainer) goes on from exactly the tokens, with no
tokenizing again."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE
from pydantic import ValidationError

torch = pytest.importorskip("torch")

from batchfleet.producer.gateway.answers import chat_response, completion_response  # noqa: E402
from batchfleet.producer.gateway.endpoint import Answered  # noqa: E402
from batchfleet.schemas.errors import ErrorCode  # noqa: E402
from batchfleet.schemas.inputs import TokenPrompt  # noqa: E402
from batchfleet.schemas.messages import Request  # noqa: E402
from batchfleet.worker.inbox import Cancel  # noqa: E402
from batchfleet.worker.runner import Prepared, PrepareError  # noqa: E402
from batchfleet.worker.runners.embedding import EmbeddingRunner  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_runner import Driver, prepare, run  # noqa: E402
from virtual_world import MODEL, T0, rig  # noqa: E402

PROMPT = "the man was"


@pytest.fixture(scope="module", params=["padded", "paged"])
def runner(tiny_lm: Path, request: pytest.FixtureRequest) -> TextGenerationRunner:
    return TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, "engine": request.param})  # fmt: skip


def req(rid: str, **kw: Any) -> Request:
    kw.setdefault("inputs", [PROMPT])
    kw.setdefault("model", "lm")
    return Request(id=rid, **kw)


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
        # each output's stream begins with its prompt's ids (vLLM's first chunk of a choice)
        assert chunks[0]["prompt_token_ids"] == prompt
        assert all("prompt_token_ids" not in c for c in chunks[1:])
    # without it, none
    (plain,) = run(runner, req("p", max_new_tokens=4))["p"]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    (prep,) = prepare(runner, req("q", max_new_tokens=3, stream=True))
    d = Driver(runner)
    d.step([("q", prep)])
    d.run()
    assert d.partials["q"] and all("prompt_token_ids" not in c for c in d.partials["q"])


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


def test_max_new_tokens_0_answers_the_prompt_alone_without_the_engine(
    runner: TextGenerationRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: two text inputs and one of token ids, two completions each, streamed, with
    # their token ids and log-probabilities asked (a tokenizer's count)
    ids = runner.tokenizer("a b c")["input_ids"]
    (prep,) = prepare(runner, req("z", inputs=[PROMPT, "there were many", {"prompt_token_ids": ids}],
                                  max_new_tokens=0, n=2, stream=True, return_token_ids=True,
                                  logprobs=1, temperature=1.0, seed=2))  # fmt: skip
    # the scheduler plans no KV cache for it, and nothing to generate
    assert prep.prompts == (0,) * 6 and prep.max_new_tokens == 0
    added: list[str] = []
    add = runner.engine.add
    monkeypatch.setattr(runner.engine, "add", lambda name, *a, **kw: (added.append(name),
                                                                     add(name, *a, **kw)))  # fmt: skip
    # When: it is admitted
    d = Driver(runner)
    d.step([("z", prep)])
    # Then: answered in that very step, with no engine work and no delta
    assert "z" in d.finals and not added and "z" not in d.partials
    assert not runner._reqs and not runner._by_seq and d.reports[0].produced == {}
    outs = d.finals["z"].outputs
    for i, prompt in enumerate([runner.tokenizer(PROMPT)["input_ids"],
                                runner.tokenizer("there were many")["input_ids"], ids]):  # fmt: skip
        first, second = outs[2 * i], outs[2 * i + 1]
        for out in (first, second):
            assert out["text"] == "" and out["completion_tokens"] == 0
            assert out["finish_reason"] == "length"
            assert out["prompt_tokens"] == len(prompt)
            assert out["token_ids"] == [] and out["logprobs"] == []
            assert "stop_reason" not in out
        assert first["prompt_token_ids"] == prompt and "prompt_token_ids" not in second
    # a plain request beside it goes on as ever, through the engine
    (plain,) = run(runner, req("p", max_new_tokens=3))["p"]
    assert plain["completion_tokens"] == 3 and added


def test_min_new_tokens_with_max_new_tokens_0_is_refused() -> None:
    with pytest.raises(ValidationError, match="min_new_tokens 1 > max_new_tokens 0"):
        req("m", max_new_tokens=0, min_new_tokens=1)
    assert req("m", max_new_tokens=0, min_new_tokens=0).max_new_tokens == 0


def test_return_prompt_text_gives_each_input_s_prompt_as_the_model_read_it(
    runner: TextGenerationRunner,
) -> None:
    tok = runner.tokenizer
    long = "there were many years of time and " * 3
    kept = tok(long)["input_ids"][-5:]
    special = tok(PROMPT)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    msgs = [{"role": "user", "content": "what is this"}]
    outs = run(runner,
               req("t", inputs=[PROMPT, {"prompt_token_ids": special}], n=2, max_new_tokens=3,
                   return_prompt_text=True),
               req("cut", inputs=[long, "it"], truncate_prompt_tokens=5, max_new_tokens=0,
                   return_prompt_text=True),
               req("c", inputs=[], messages=msgs, max_new_tokens=2, return_prompt_text=True,
                   return_token_ids=True),
               req("no", max_new_tokens=0))  # fmt: skip
    # a text as sent; token ids decoded, their special tokens kept; only in each input's
    # first output
    shown = tok.decode(special, skip_special_tokens=False)
    assert [o.get("prompt_text") for o in outs["t"]] == [PROMPT, None, shown, None]
    assert outs["t"][2]["prompt_text"].endswith("<|im_end|>")
    # a text truncate_prompt_tokens cut: the tokens kept, decoded; one it did not, as sent
    cut = tok.decode(kept, skip_special_tokens=False)
    assert [o["prompt_text"] for o in outs["cut"]] == [cut, "it"]
    assert outs["cut"][0]["prompt_tokens"] == 5
    # a chat: its template as rendered, whose tokens are the prompt's
    (chat,) = outs["c"]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat["prompt_text"] == rendered
    assert chat["prompt_token_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    # not asked: none
    assert "prompt_text" not in outs["no"][0]


def test_a_chat_s_prompt_text_is_its_rendered_template_where_decoding_differs(
    tiny_lm: Path, tmp_path: Path
) -> None:
    # a tokenizer that normalizes (NFKC: "ﬁ" -> "fi", "①" -> "1"): the rendered template's
    # tokens decode to another text, so the template must be what is answered
    from tokenizers import Tokenizer, normalizers

    model = tmp_path / "nfkc"
    shutil.copytree(tiny_lm, model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.normalizer = normalizers.NFKC()
    tok.save(str(model / "tokenizer.json"))
    runner = TextGenerationRunner(model, device=DEVICE, dtype="float32",
                                  options=TINY_LM_OPTIONS)  # fmt: skip
    msgs = [{"role": "user", "content": "a ﬁne day ①"}]
    (chat,) = run(runner, req("c", inputs=[], messages=msgs, max_new_tokens=0,
                              return_prompt_text=True, return_token_ids=True))["c"]  # fmt: skip
    rendered = runner.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                    tokenize=False)  # fmt: skip
    decoded = runner.tokenizer.decode(chat["prompt_token_ids"], skip_special_tokens=False)
    assert "a fine day 1" in decoded and decoded != rendered
    assert chat["prompt_text"] == rendered


def test_a_request_cancelled_while_waiting_has_empty_token_ids_and_its_prompt_s(
    runner: TextGenerationRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: the real loop and runner (virtual time) with room for two running sequences:
    # one generates, two requests wait behind it, one of two completions with token ids,
    # log-probabilities and its prompt's text asked
    monkeypatch.setattr(runner, "max_running", 2)
    r = rig(runner, cost=lambda work: 0.01)
    for rid, kw in (("run", {"max_new_tokens": 40, "return_token_ids": True}),
                    ("wait", {"n": 2, "return_token_ids": True, "logprobs": 1,
                              "return_prompt_text": True}),
                    ("plain", {})):  # fmt: skip
        r.source.add(req(rid, model=MODEL, **kw))
    # When: the waiting ones are cancelled before they start
    r.world.at(T0 + 0.05, lambda: r.loop.parts.inbox.put(Cancel(("wait", "plain"))))
    r.run()
    # Then: each output says nothing was generated, as a list (vLLM's abort output: no new
    # token ids), and counts its prompt's tokens as the one that ran does (vLLM's too); the
    # first carries the prompt's ids and text; a request that did not ask has none
    (ran,) = r.result("run").generations()
    assert ran.token_ids and len(ran.token_ids) == ran.completion_tokens
    assert ran.prompt_token_ids and ran.prompt_tokens == len(ran.prompt_token_ids)
    waited = r.result("wait").generations()
    assert len(waited) == 2
    for g in waited:
        assert (g.finish_reason, g.text, g.completion_tokens) == ("cancelled", "", 0)
        assert g.token_ids == [] and g.logprobs == [] and g.prompt_tokens == ran.prompt_tokens
    assert waited[0].prompt_token_ids == ran.prompt_token_ids and waited[0].prompt_text == PROMPT
    assert waited[1].prompt_token_ids is None and waited[1].prompt_text is None
    usage = r.result("wait").usage
    assert usage is not None and usage.prompt_tokens == ran.prompt_tokens  # (once per input)
    (plain,) = r.result("plain").generations()
    assert plain.finish_reason == "cancelled" and plain.prompt_tokens == ran.prompt_tokens
    assert plain.token_ids is None and plain.logprobs is None and plain.prompt_token_ids is None
    # the OpenAI answers show them as vLLM's do: each choice's token_ids []
    answered = Answered("x", 1)
    chat = chat_response({"return_token_ids": True, "logprobs": True}, r.result("wait"), answered)
    assert [c["token_ids"] for c in chat["choices"]] == [[], []]
    assert [c["logprobs"] for c in chat["choices"]] == [{"content": []}] * 2
    body = {"prompt": PROMPT, "return_token_ids": True, "logprobs": 1}
    completion = completion_response(body, r.result("wait"), answered)
    assert [c["token_ids"] for c in completion["choices"]] == [[], []]
