"""A chat's rendering options (vLLM's): ``chat_template_kwargs`` reach the template,
``add_generation_prompt`` false leaves the assistant's turn unopened, and
``continue_final_message`` goes on from the last assistant message's content; requests
that do not hold together are refused when read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE
from pydantic import ValidationError

torch = pytest.importorskip("torch")

from batchfleet.schemas.messages import TEMPLATE_NAMES, Request  # noqa: E402
from batchfleet.worker.runner import Prepared, PrepareError  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_runner import greedy, run  # noqa: E402

THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}{% endif %}"
    "{% endif %}"
)
"""A template with variables of its own (Qwen3's ``enable_thinking``, gpt-oss's
``reasoning_effort``)."""
CHAT = [{"role": "user", "content": "the man was"}]


@pytest.fixture(scope="module")
def runner(tiny_lm: Path) -> TextGenerationRunner:
    return TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32", options=TINY_LM_OPTIONS)


def prompt(runner: TextGenerationRunner, **kw: Any) -> str:
    kw.setdefault("messages", CHAT)
    (prep,) = runner.prepare_many([Request(id="c", model="lm", **kw)])
    assert isinstance(prep, Prepared), prep
    return str(runner.tokenizer.decode(list(prep.payload.prompts[0])))


def test_template_kwargs_reach_the_template(runner: TextGenerationRunner) -> None:
    tok = runner.tokenizer
    template, tok.chat_template = tok.chat_template, THINKING
    try:
        off = prompt(runner, chat_template_kwargs={"enable_thinking": False})
        on = prompt(runner, chat_template_kwargs={"enable_thinking": True})
        plain = prompt(runner)
        high = prompt(runner, reasoning_effort="high")
    finally:
        tok.chat_template = template
    assert off.endswith("<|im_start|>assistant\n<think></think>")
    assert high == plain + "effort: high"  # OpenAI's reasoning_effort: a template variable
    assert on == plain and plain.endswith("<|im_start|>assistant\n")


def test_add_generation_prompt_false_leaves_the_turn_unopened(runner: TextGenerationRunner) -> None:
    opened = prompt(runner)
    closed = prompt(runner, add_generation_prompt=False)
    assert opened == closed + "<|im_start|>assistant\n"


def test_continue_final_message_goes_on_from_its_content(runner: TextGenerationRunner) -> None:
    turns = [*CHAT, {"role": "assistant", "content": "a dog and"}]
    text = prompt(runner, messages=turns, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\na dog and")  # not closed, no new turn
    # the text goes on from it: greedy from that very prompt
    req = Request(id="go", model="lm", messages=turns, continue_final_message=True,
                  max_new_tokens=8)  # fmt: skip
    (out,) = run(runner, req)["go"]
    assert out["text"] == greedy(runner, text, 8)


BAD = [
    ({"chat_template_kwargs": {"tools": []}}, "may not set tools"),
    ({"chat_template_kwargs": {"x": "y" * 5000}}, "too_large"),
    ({"continue_final_message": True}, "last assistant message"),
    ({"continue_final_message": True, "add_generation_prompt": True,
      "messages": [*CHAT, {"role": "assistant", "content": "a"}]}, "not both"),
    ({"messages": None, "inputs": ["x"], "add_generation_prompt": False}, "goes with a chat"),
    ({"messages": None, "inputs": ["x"], "reasoning_effort": "low"}, "goes with a chat"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "low"}}, "twice"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_requests_that_do_not_hold_together_are_refused(
    fields: dict[str, Any], message: str
) -> None:
    body = {"id": "r", "model": "lm", "messages": CHAT, **fields}
    with pytest.raises(ValidationError, match=message):
        Request.model_validate(body)


def test_a_template_that_fails_is_an_error_result(runner: TextGenerationRunner) -> None:
    tok = runner.tokenizer
    template, tok.chat_template = tok.chat_template, "{{ raise_exception('no ' + mode) }}"
    try:
        (prep,) = runner.prepare_many([Request(id="f", model="lm", messages=CHAT,
                                               chat_template_kwargs={"mode": "thanks"})])  # fmt: skip
    finally:
        tok.chat_template = template
    assert isinstance(prep, PrepareError) and "no thanks" in str(prep)


def test_template_kwargs_cannot_set_the_template_call_s_own_arguments() -> None:
    import inspect

    from transformers import PreTrainedTokenizerFast

    own = set(inspect.signature(PreTrainedTokenizerFast.apply_chat_template).parameters)
    assert own - {"self", "kwargs"} <= TEMPLATE_NAMES  # a newer transformers' too
