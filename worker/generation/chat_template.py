"""A model's chat template and its defaults: vLLM's ``--chat-template``,
``--default-chat-template-kwargs``, ``--trust-request-chat-template`` and
``--chat-template-content-format``, as runner options.

``chat_template`` is a file's path or the template itself, told apart as vLLM does (a
value that is no file it can open and holds none of ``{``, ``}`` or a newline is a
missing file, an error); it replaces the tokenizer's own. A request's own ``chat_template``
renders only where ``trust_request_chat_template`` is set (vLLM refuses it otherwise).
Templates render in transformers' sandbox (``ImmutableSandboxedEnvironment``), whichever
their source. ``chat_template_content_format`` says how a message's content reaches the
template: ``string`` (text parts joined by newlines) or ``openai`` (a list of
``{"type": "text", "text": ...}`` parts); ``auto`` reads it off the template, as vLLM
does: one that loops over a message's ``content`` takes parts. A request's
``chat_template`` that names one of the tokenizer's templates (transformers' named
templates: ``default``, ``tool_use``, ...) renders that one, its format read off its text
(vLLM reads the name's own text, which never loops: always ``string``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, cast

import jinja2
import jinja2.nodes as nodes

from ...schemas.chat import UNTRUSTED_TEMPLATE
from ...schemas.messages import TEMPLATE_NAMES, ChatMessage

ContentFormat = Literal["string", "openai"]
FORMATS: tuple[str, ...] = ("auto", "string", "openai")
JINJA_CHARS = "{}\n"
"""A ``chat_template`` value holding one of these is a template when no file opens (vLLM's)."""


class TemplateRefused(ValueError):
    """A request's ``chat_template`` this model does not render (untrusted, or invalid)."""


def compile_template(text: str) -> jinja2.Template:
    """``text`` compiled as transformers compiles chat templates (sandboxed, cached); a
    ``jinja2.TemplateError`` says where it is wrong."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return cast(jinja2.Template, _compile_jinja_template(text))


def load_template(value: str) -> str:
    """The ``chat_template`` option's template: the file at ``value`` (a path relative to
    the worker's directory, as the model's ``path``), else ``value`` itself where it holds
    template characters; a ``ValueError`` for a missing file or a template that does not
    compile."""
    try:
        text = Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # (ValueError: a NUL in a path)
        if not any(c in value for c in JINJA_CHARS):
            raise ValueError(f"options.chat_template: {value!r} looks like a file path, but it "
                             f"cannot be opened ({exc})") from None  # fmt: skip
        text = value
    try:
        compile_template(text)
    except jinja2.TemplateError as exc:
        raise ValueError(f"options.chat_template: the template does not compile: "
                         f"{type(exc).__name__}: {exc}") from None  # fmt: skip
    return text


@dataclass(frozen=True)
class ChatTemplates:
    """A model's template options (see the module docstring), checked."""

    template: str | None = None
    """The ``chat_template`` option's template (None: the tokenizer's own)."""
    default_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """``default_chat_template_kwargs``: under each request's ``chat_template_kwargs``."""
    trust_request: bool = False
    """``trust_request_chat_template``: a request's ``chat_template`` renders."""
    content_format: str = "auto"

    @classmethod
    def from_options(cls, opts: Mapping[str, Any]) -> ChatTemplates:
        """The four options out of a runner's ``options`` (a ``ValueError`` says which is
        wrong)."""
        value = opts.get("chat_template")
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError("options.chat_template: a template file's path, or a template")
        defaults = opts.get("default_chat_template_kwargs") or {}
        if not isinstance(defaults, Mapping) or not all(isinstance(k, str) for k in defaults):
            raise ValueError("options.default_chat_template_kwargs: a table of template "
                             "variables")  # fmt: skip
        if reserved := sorted(TEMPLATE_NAMES & set(defaults)):
            raise ValueError(f"options.default_chat_template_kwargs may not set "
                             f"{', '.join(reserved)}")  # fmt: skip
        trust = opts.get("trust_request_chat_template", False)
        if not isinstance(trust, bool):
            raise ValueError(f"options.trust_request_chat_template: {trust!r} is not true or "
                             "false")  # fmt: skip
        fmt = opts.get("chat_template_content_format", "auto")
        if fmt not in FORMATS:
            raise ValueError(f"options.chat_template_content_format: {fmt!r} is not one of "
                             f"{', '.join(FORMATS)}")  # fmt: skip
        template = None if value is None else load_template(value)
        return cls(template, dict(defaults), trust, fmt)

    def request_template(self, text: str | None) -> str | None:
        """A request's ``chat_template``, checked: refused unless trusted, compiled."""
        if text is None:
            return None
        if not self.trust_request:
            raise TemplateRefused(UNTRUSTED_TEMPLATE)
        try:
            compile_template(text)
        except jinja2.TemplateError as exc:
            raise TemplateRefused(f"chat_template does not compile: {type(exc).__name__}: "
                                  f"{exc}") from None  # fmt: skip
        return text

    def kwargs(self, request: Mapping[str, Any] | None) -> dict[str, Any]:
        """The template's variables: the defaults, a request's over them (vLLM's order)."""
        return {**self.default_kwargs, **(request or {})}

    def format_for(self, template: str | None) -> ContentFormat:
        """How content reaches ``template``: the option, or (``auto``) read off it."""
        if self.content_format != "auto":
            return cast(ContentFormat, self.content_format)
        return "string" if template is None else detect_format(template)


def content(m: ChatMessage, fmt: ContentFormat) -> str | list[dict[str, str]]:
    """A message's content as a template in ``fmt`` takes it (vLLM's): its text parts
    joined by newlines, or each part (a text one part) as ``{"type": "text", ...}``."""
    if m.content is None:
        parts: list[str] = []
    elif isinstance(m.content, str):
        parts = [m.content]
    else:
        parts = [p.text for p in m.content]
    if fmt == "openai":
        return [{"type": "text", "text": t} for t in parts]
    return "\n".join(parts)


# --- vLLM's detection of the content format (chat_utils.py), over the template's AST ---


def _is_var(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, nodes.Const) and (
            node.arg.value == key)  # fmt: skip
    return isinstance(node, nodes.Getattr) and _is_var(node.node, name) and node.attr == key


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or its ``key``), maybe filtered, tested or sliced."""
    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: nodes.Template, name: str) -> Iterator[str]:
    """``name`` and the variables assigned from it, transitively."""
    yield name
    todo = deque([name])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, current) and isinstance(assign.target, nodes.Name):
                yield assign.target.name
                if assign.target.name != current:
                    todo.append(assign.target.name)


def _loops_over(root: nodes.Template, names: list[str], key: str | None) -> Iterator[str]:
    """The targets of ``for`` loops over one of ``names`` (or its ``key``)."""
    for loop in root.find_all(nodes.For):
        if any(_reads(loop.iter, n, key) for n in names) and isinstance(loop.target, nodes.Name):
            yield loop.target.name


@lru_cache(maxsize=32)
def detect_format(template: str) -> ContentFormat:
    """``openai`` where the template loops over a message's ``content`` (``for part in
    message['content']``, or ``for item in content``), else ``string``; a template that
    does not parse: ``string``."""
    try:
        root = compile_template(template).environment.parse(template)
    except jinja2.TemplateError:
        return "string"
    messages = list(_aliases(root, "messages"))
    each = list(_loops_over(root, messages, None))
    if next(_loops_over(root, each, "content"), None) is not None:
        return "openai"
    return "openai" if next(_loops_over(root, ["content"], None), None) is not None else "string"
