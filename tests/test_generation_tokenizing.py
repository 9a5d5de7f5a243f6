"""How the worker tokenizes a prompt as asked and tells a client about it: vLLM's
``add_special_tokens`` (a text without the tokenizer's BOS, a chat with it), its
``/tokenize``'s token strings (``return_token_strs``), and a stream's first delta of each
input carrying the ``prompt_text`` and ``prompt_logprobs`` its result holds (so a
streamed ``echo`` begins with the prompt)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.messages import Request  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_runner import Driver, prepare, run  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

BOS = "<|im_start|>"
PROMPT = "the man was"
CHAT = [{"role": "user", "content": "what is this"}]


def with_bos(path: Path) -> Path:
    """The tiny Llama whose tokenizer adds ``BOS`` before a text (as Llama's adds ``<s>``)."""
    make_causal_lm(path)
    file = path / "tokenizer.json"
    spec = json.loads(file.read_text())
    (bos_id,) = [t["id"] for t in spec["added_tokens"] if t["content"] == BOS]
    first = [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    spec["post_processor"] = {
        "type": "TemplateProcessing", "single": first,
        "pair": [*first, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }  # fmt: skip
    file.write_text(json.dumps(spec))
    return path


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> TextGenerationRunner:
    path = with_bos(tmp_path_factory.mktemp("bos") / "lm")
    return TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, "engine": "padded"})  # fmt: skip


def req(rid: str, **kw: Any) -> Request:
    kw.setdefault("inputs", [PROMPT])
    return Request(id=rid, model="lm", **kw)


def test_add_special_tokens_as_vllm_takes_it(runner: TextGenerationRunner) -> None:
    tok = runner.tokenizer
    bos = tok.convert_tokens_to_ids(BOS)
    plain = tok(PROMPT, add_special_tokens=False)["input_ids"]
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    template = tok(rendered, add_special_tokens=False)["input_ids"]
    chat = {"inputs": [], "messages": CHAT}
    outs = run(runner,
               req("text", max_new_tokens=0, return_token_ids=True),
               req("text-yes", max_new_tokens=0, return_token_ids=True, add_special_tokens=True),
               req("text-no", max_new_tokens=0, return_token_ids=True, add_special_tokens=False),
               req("chat", **chat, max_new_tokens=0, return_token_ids=True),
               req("chat-no", **chat, max_new_tokens=0, return_token_ids=True,
                   add_special_tokens=False),
               req("chat-yes", **chat, max_new_tokens=0, return_token_ids=True,
                   add_special_tokens=True, return_prompt_text=True),
               req("ids", inputs=[{"prompt_token_ids": plain}], max_new_tokens=0,
                   return_token_ids=True, add_special_tokens=True))  # fmt: skip
    ids = {k: v[0]["prompt_token_ids"] for k, v in outs.items()}
    # a text: with the tokenizer's BOS unless told not
    assert ids["text"] == ids["text-yes"] == [bos, *plain]
    assert ids["text-no"] == plain and outs["text-no"][0]["prompt_tokens"] == len(plain)
    # a chat: its template's tokens only, unless told to add the tokenizer's too
    assert ids["chat"] == ids["chat-no"] == template
    assert ids["chat-yes"] == [bos, *template] and template[0] == bos  # vLLM's double BOS
    assert outs["chat-yes"][0]["prompt_text"] == rendered
    # token ids are taken as they are
    assert ids["ids"] == plain
    # and a generation reads the prompt so tokenized
    (gen,) = run(runner, req("g", max_new_tokens=2, add_special_tokens=False,
                             return_token_ids=True))["g"]  # fmt: skip
    assert gen["prompt_token_ids"] == plain and gen["prompt_tokens"] == len(plain)


def test_return_token_strs_gives_each_input_s_token_strings(runner: TextGenerationRunner) -> None:
    tok = runner.tokenizer
    outs = run(runner, req("s", inputs=[PROMPT, "it"], n=2, max_new_tokens=1,
                           return_token_strs=True, return_token_ids=True),
               req("none", max_new_tokens=0))  # fmt: skip
    first, second, third, _ = outs["s"]
    assert first["prompt_token_strs"] == tok.convert_ids_to_tokens(first["prompt_token_ids"])
    assert first["prompt_token_strs"] == [BOS, "th", "e", "Ġman", "Ġw", "as"]
    assert third["prompt_token_strs"] == [BOS, "i", "t"]
    assert "prompt_token_strs" not in second and "prompt_token_strs" not in outs["none"][0]


def test_a_stream_s_first_delta_of_each_input_carries_its_prompt(
    runner: TextGenerationRunner,
) -> None:
    ids = runner.tokenizer(PROMPT)["input_ids"]
    asked = req("e", inputs=[PROMPT, {"prompt_token_ids": ids[1:]}], n=2, max_new_tokens=4,
                stream=True, prompt_logprobs=1, logprobs=1, return_prompt_text=True)  # fmt: skip
    (prep,) = prepare(runner, asked)
    d = Driver(runner)
    d.step([("e", prep)])
    d.run()
    outs = d.finals["e"].outputs
    for i, out in enumerate(outs):
        chunks = [c for c in d.partials["e"] if c["input"] == i]
        first, rest = chunks[0], chunks[1:]
        if i % 2 == 0:  # an input's first output: what its result holds of the prompt
            assert first["prompt_text"] == out["prompt_text"]
            assert first["prompt_logprobs"] == out["prompt_logprobs"]
            assert first["prompt_logprobs"][0] is None
            assert len(first["prompt_logprobs"]) == out["prompt_tokens"]
        else:
            assert "prompt_text" not in first and "prompt_logprobs" not in first
        assert all("prompt_text" not in c and "prompt_logprobs" not in c for c in rest)
    assert outs[2]["prompt_text"] == runner.tokenizer.decode(ids[1:])
    # not asked: none
    (prep,) = prepare(runner, req("p", max_new_tokens=2, stream=True))
    d = Driver(runner)
    d.step([("p", prep)])
    d.run()
    assert all("prompt_text" not in c and "prompt_logprobs" not in c for c in d.partials["p"])
