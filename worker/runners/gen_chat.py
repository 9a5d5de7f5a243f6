"""A text-generation request's prompts as token ids: a chat rendered with the model's
(or the request's, or the options') chat template, texts tokenized, token prompts checked
against the vocabulary.

Runs on the loop thread when a request is read (:class:`~.gen_prepare.Preparing`).
"""

from __future__ import annotations

import json
from typing import Any

from ...schemas.errors import ErrorCode
from ...schemas.inputs import TokenPrompt
from ...schemas.messages import ChatMessage, Request
from ..generation.chat_template import ContentFormat, TemplateRefused
from ..generation.chat_template import content as template_content
from ..runner import PrepareError
from .gen_state import RunnerState


def _turn(m: ChatMessage, fmt: ContentFormat = "string") -> dict[str, Any]:
    """A chat message as chat templates take it: its content in the template's ``fmt``; an
    earlier call's arguments as an object where they parse (HF's convention; the text
    otherwise)."""
    turn: dict[str, Any] = {"role": m.role, "content": template_content(m, fmt)}
    if m.tool_calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": c.type,
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls
        ]  # fmt: skip
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        turn["name"] = m.name
    if m.reasoning_content is not None:  # Qwen3's and R1's name, vLLM's, and gpt-oss's
        turn["reasoning_content"] = turn["reasoning"] = turn["thinking"] = m.reasoning_content
    return turn


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class ChatPrompts(RunnerState):
    """Renders and tokenizes a request's prompts."""

    def _prompts(self, req: Request) -> tuple[list[list[int]], list[str | None]]:
        """Each input's prompt tokens, and its text where there is one: a text input's,
        a chat's rendered template (rendered only for ``return_prompt_text``)."""
        if req.messages is not None:
            try:
                template = self.templates.request_template(req.chat_template)
            except TemplateRefused as exc:
                raise PrepareError(str(exc)) from None
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            if template is None and not getattr(self.tokenizer, "chat_template", None):
                raise PrepareError("this model has no chat template: send `inputs` (prompts), "
                                   "or set its chat_template option")  # fmt: skip
            # the template's text: the tokenizer's own (its named ``tool_use`` one for tools),
            # or the one a request names, so the content format is read off the text
            template = self.tokenizer.get_chat_template(template, tools=tools)
            go_on = bool(req.continue_final_message)
            variables = self.templates.kwargs(req.chat_template_kwargs)
            if req.reasoning_effort is not None:  # over a default's
                variables["reasoning_effort"] = req.reasoning_effort
            kwargs: dict[str, Any] = dict(
                tools=tools,
                add_generation_prompt=not go_on and req.add_generation_prompt is not False,
                continue_final_message=go_on,
                chat_template=template,
                **variables,
            )
            fmt = self.templates.format_for(template)
            turns = [_turn(m, fmt) for m in req.messages]
            text = None
            if req.return_prompt_text or req.add_special_tokens:  # as rendered
                text = str(self.tokenizer.apply_chat_template(turns, tokenize=False, **kwargs))
            if req.add_special_tokens:  # vLLM's: the tokenizer's own added to the template's
                return [list(self.tokenizer(text)["input_ids"])], [text]
            ids = self.tokenizer.apply_chat_template(turns, tokenize=True, **kwargs)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [list(ids)], [text if req.return_prompt_text else None]
        prompts: list[list[int]] = []
        texts: list[str | None] = []
        for i, item in enumerate(req.inputs):
            texts.append(item if isinstance(item, str) else None)
            if isinstance(item, str):
                special = req.add_special_tokens is not False
                prompts.append(list(self.tokenizer(item, add_special_tokens=special)["input_ids"]))
            elif isinstance(item, TokenPrompt):  # taken as they are
                if (top := max(item.prompt_token_ids)) >= self.vocab_size:
                    raise PrepareError(f"inputs[{i}].prompt_token_ids: {top} is not a token of "
                                       f"this model (vocabulary {self.vocab_size})",
                                       ErrorCode.INVALID_INPUT)  # fmt: skip
                prompts.append(list(item.prompt_token_ids))
            else:
                raise PrepareError("a text-generation model takes texts or prompt_token_ids "
                                   "(prompts), or messages", ErrorCode.INVALID_INPUT)  # fmt: skip
        return prompts, texts
