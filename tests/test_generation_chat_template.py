"""A model's chat template options (vLLM's ``--chat-template``,
``--default-chat-template-kwargs``, ``--trust-request-chat-template``,
``--chat-template-content-format``) and a request's own ``chat_template``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.chat import UNTRUSTED_TEMPLATE  # noqa: E402
from batchfleet.schemas.errors import ErrorCode  # noqa: E402
from batchfleet.schemas.messages import Request  # noqa: E402
from batchfleet.worker.generation.chat_template import ChatTemplates, detect_format  # noqa: E402
from batchfleet.worker.runner import Prepared, PrepareError  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402

PLAIN = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
"""A template of the option's (not the model's own ChatML)."""
MOOD = "{% for m in messages %}{{ m['content'] }}{% endfor %}|{{ mood }}|{{ size | default('-') }}"
PARTS = (
    "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
)
"""A template that loops over a message's parts (``auto`` reads ``openai`` off it)."""
AS_IS = "{% for m in messages %}{{ m['content'] }};{% endfor %}"
CHAT = [{"role": "user", "content": "the man"}]


@pytest.fixture(scope="module")
def bare_lm(tiny_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with no chat template of its own."""
    path = tmp_path_factory.mktemp("bare-lm") / "lm"
    shutil.copytree(tiny_lm, path)
    (path / "chat_template.jinja").unlink()
    return path


def load(path: Path, **options: Any) -> TextGenerationRunner:
    return TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, **options})  # fmt: skip


def rendered(runner: TextGenerationRunner, **kw: Any) -> str:
    """The prompt a chat request renders to (``return_prompt_text``)."""
    kw.setdefault("messages", CHAT)
    (prep,) = runner.prepare_many([Request(id="c", model="lm", return_prompt_text=True, **kw)])
    assert isinstance(prep, Prepared), prep
    text = (prep.payload.prompt_texts or ())[0]
    assert isinstance(text, str)
    assert list(prep.payload.prompts[0]) == runner.tokenizer(text, add_special_tokens=False)[
        "input_ids"]  # fmt: skip
    return text


def refused(runner: TextGenerationRunner, **kw: Any) -> PrepareError:
    kw.setdefault("messages", CHAT)
    (prep,) = runner.prepare_many([Request(id="c", model="lm", **kw)])
    assert isinstance(prep, PrepareError)
    return prep


def test_a_model_without_a_template_renders_the_option_s(bare_lm: Path, tmp_path: Path) -> None:
    # Given the same template inline, and in a file
    file = tmp_path / "plain.jinja"
    file.write_text(PLAIN)
    # Then the bare model refuses chats, and renders them with either
    assert "no chat template" in str(refused(load(bare_lm)))
    assert rendered(load(bare_lm, chat_template=PLAIN)) == "[user]the man"
    runner = load(bare_lm, chat_template=str(file))
    assert rendered(runner) == "[user]the man"
    assert runner.tokenizer.chat_template == PLAIN  # what the model info publishes


def test_the_option_replaces_the_model_s_own(tiny_lm: Path) -> None:
    assert rendered(load(tiny_lm)).startswith("<|im_start|>user\n")
    assert rendered(load(tiny_lm, chat_template=PLAIN)) == "[user]the man"


def test_default_kwargs_reach_the_template_under_the_request_s(tiny_lm: Path) -> None:
    runner = load(tiny_lm, chat_template=MOOD, default_chat_template_kwargs={"mood": "calm"})
    assert rendered(runner) == "the man|calm|-"
    assert rendered(runner, chat_template_kwargs={"mood": "glad", "size": 2}) == "the man|glad|2"
    assert rendered(runner) == "the man|calm|-"  # a request's never sticks


def test_a_request_s_reasoning_effort_wins_over_a_default(tiny_lm: Path) -> None:
    runner = load(tiny_lm, chat_template="{{ reasoning_effort }}",
                  default_chat_template_kwargs={"reasoning_effort": "low"})  # fmt: skip
    assert rendered(runner) == "low"
    assert rendered(runner, reasoning_effort="high") == "high"


def test_a_request_s_template_is_refused_unless_trusted(tiny_lm: Path) -> None:
    prep = refused(load(tiny_lm), chat_template=PLAIN)
    assert prep.code == ErrorCode.INVALID_REQUEST and str(prep) == UNTRUSTED_TEMPLATE
    trusting = load(tiny_lm, trust_request_chat_template=True)
    assert rendered(trusting, chat_template=PLAIN) == "[user]the man"
    assert rendered(trusting).startswith("<|im_start|>user\n")  # the model's, without one
    bad = refused(trusting, chat_template="{% for m in messages %}")
    assert bad.code == ErrorCode.INVALID_REQUEST and "does not compile" in str(bad)


def test_a_trusted_request_template_serves_a_model_without_one(bare_lm: Path) -> None:
    runner = load(bare_lm, trust_request_chat_template=True)
    assert rendered(runner, chat_template=PLAIN) == "[user]the man"


def test_request_templates_are_sandboxed(tiny_lm: Path) -> None:
    runner = load(tiny_lm, trust_request_chat_template=True)
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    prep = refused(runner, chat_template=escape)
    assert "SecurityError" in str(prep) or "unsafe" in str(prep), prep


def test_list_content_in_each_format(tiny_lm: Path) -> None:
    chat = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]  # fmt: skip
    text = [{"role": "user", "content": "a"}]
    as_string = load(tiny_lm, chat_template=AS_IS, chat_template_content_format="string")
    assert rendered(as_string, messages=chat) == "a\nb;"
    as_parts = load(tiny_lm, chat_template=PARTS, chat_template_content_format="openai")
    assert rendered(as_parts, messages=chat) == "<a><b>"
    assert rendered(as_parts, messages=text) == "<a>"  # a text is one part
    auto = load(tiny_lm, chat_template=PARTS)  # auto: read off the template
    assert rendered(auto, messages=chat) == "<a><b>"
    forced = load(tiny_lm, chat_template=AS_IS, chat_template_content_format="openai")
    assert "'text': 'a'" in rendered(forced, messages=chat)


def test_a_named_template_s_format_is_read_off_its_text(tiny_lm: Path) -> None:
    # Given a tokenizer with named templates, one of which takes parts
    runner = load(tiny_lm, trust_request_chat_template=True)
    runner.tokenizer.chat_template = {"default": AS_IS, "parts": PARTS}
    chat = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]  # fmt: skip
    # When a request names it, Then it renders with parts (read off its text, not its name)
    assert rendered(runner, messages=chat, chat_template="parts") == "<a><b>"
    assert rendered(runner, messages=chat) == "a\nb;"  # the default: joined
    assert rendered(runner, messages=chat, chat_template=PARTS) == "<a><b>"  # a template


DETECTED = [
    (AS_IS, "string"),
    (PARTS, "openai"),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    ("{% set turns = messages[1:] %}{% for m in turns %}"
     "{% for p in m['content'] | list %}{{ p }}{% endfor %}{% endfor %}", "openai"),
    ("{% macro show(content) %}{% for item in content %}{{ item }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(m['content']) }}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for x in m['tool_calls'] %}{{ x }}{% endfor %}{% endfor %}",
     "string"),
    ("{% for m in messages %}", "string"),  # does not parse: the default
]  # fmt: skip


@pytest.mark.parametrize(("template", "fmt"), DETECTED)
def test_auto_detects_the_content_format_as_vllm_does(template: str, fmt: str) -> None:
    assert detect_format(template) == fmt


BAD_OPTIONS = [
    ({"chat_template": "templates/missing.jinja"}, "looks like a file path"),
    ({"chat_template": "{% if %}"}, "does not compile"),
    ({"chat_template": 3}, "options.chat_template"),
    ({"default_chat_template_kwargs": {"tools": []}}, "may not set tools"),
    ({"default_chat_template_kwargs": ["x"]}, "default_chat_template_kwargs"),
    ({"trust_request_chat_template": "yes"}, "not true or false"),
    ({"chat_template_content_format": "parts"}, "not one of auto, string, openai"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_bad_options_are_load_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChatTemplates.from_options(options)


def test_a_request_s_template_is_bounded_and_goes_with_a_chat() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="at most 65536"):
        Request(id="c", model="lm", messages=CHAT, chat_template="x" * 65_537)
    with pytest.raises(ValidationError, match="goes with a chat"):
        Request(id="c", model="lm", inputs=["x"], chat_template=PLAIN)
