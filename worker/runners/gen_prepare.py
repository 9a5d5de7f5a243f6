"""A text-generation request checked and turned into a :class:`~.gen_state.GenSpec`:
sampling defaults applied, prompts bounded, ``max_new_tokens`` capped, LoRA, tool choice,
reasoning split, thinking budgets, stop/bias/allowed tokens checked, and its constraint
(``structured_outputs``, ``response_format``, the calls ``tool_choice`` asks for) submitted
to the compiler. A request the model cannot serve is a :class:`~..runner.PrepareError`.

Runs on the loop thread when a request is read, never per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from ...schemas.errors import ErrorCode
from ...schemas.messages import Request, StructuredOutputs
from ...schemas.tools import called
from ..generation import cohere, harmony, strict_calls, struct_tag
from ..generation.grammar import Constraint, GrammarError
from ..generation.sampling import Sampling
from ..generation.tagged_args import TYPED_ARGS, param_types
from ..generation.think_budget import ThinkBudget
from ..generation.tools import ALIASES
from ..runner import Prepared, PrepareError
from .gen_chat import ChatPrompts
from .gen_state import GenSpec


class Preparing(ChatPrompts):
    """The loop thread's side of the runner: requests read into specs."""

    def prepare_many(self, requests: Sequence[Request]) -> list[Prepared | PrepareError]:
        return [self._prepare(r) for r in requests]

    def _prepare(self, req: Request) -> Prepared | PrepareError:
        req = self.sampling_defaults.apply(req)  # the model's, for the fields left unset
        try:
            prompts, texts = self._prompts(req)
        except PrepareError as exc:
            return exc
        except Exception as exc:
            return PrepareError(f"cannot tokenize: {type(exc).__name__}: {exc}")
        if req.truncate_prompt_tokens is not None:  # vLLM's: keep the last ones
            cut = [p[-req.truncate_prompt_tokens :] for p in prompts]
            texts = [t if len(c) == len(p) else None
                     for t, c, p in zip(texts, cut, prompts, strict=True)]  # fmt: skip
            prompts = cut
        for i, p in enumerate(prompts):
            if not p:
                return PrepareError(f"input {i} has no tokens", ErrorCode.EMPTY_INPUT)
            if len(p) > self.max_prompt_tokens:
                return PrepareError(
                    f"input {i} has {len(p)} prompt tokens > {self.max_prompt_tokens} "
                    f"(context {self.context})",
                    ErrorCode.TOO_LARGE,
                )
        # bounded by the limits; 0 (falsy) is the prompt only
        wanted = (self.default_new_tokens if req.max_new_tokens is None
                  else self._capped(req.max_new_tokens))  # fmt: skip
        at_least = req.min_new_tokens or 0
        if at_least > wanted:
            return PrepareError(f"min_new_tokens {at_least} > max_new_tokens {wanted}")
        lora = 0
        if req.lora is not None:
            labels = self._loras.labels
            if req.lora not in labels:
                known = ", ".join(labels) or "none"
                return PrepareError(f"lora {req.lora!r} is not one of this model's adapters "
                                    f"({known})")  # fmt: skip
            lora = labels[req.lora]
        use = req.tool_use
        if use is not None and use.kind == "auto" and self.tool_call_parser is None:
            return PrepareError("tool_choice auto (the default with tools) reads calls out of "
                                "the text with the model's tool_call_parser option, which this "
                                "model does not set: send tool_choice required, a named "
                                "function, or none")  # fmt: skip
        constraint: Constraint | None = None
        compiling: Future[Constraint] | None = None
        # gpt-oss writes the calls tool_choice asks for as harmony calls, after its
        # analysis (harmony.calls_grammar), Cohere Command as its calls part, after its
        # reasoning (cohere.calls_grammar): the text is split, constrained from the first
        own_calls = (
            (self._harmony or self._cohere is not None or self._blocks is not None)
            and req.constraint is not None
            and req.structured_outputs is None and req.response_format is None
        )  # fmt: skip
        # a chat to a reasoning model is split; a constraint then begins after its
        # reasoning, where </think> is one token (else it holds from the first: no split),
        # or from the first token where the prompt closed the reasoning; gpt-oss's in its
        # final message, Cohere's after its answer's marker, or, for calls, from the first
        # token (the grammar frees the reasoning)
        thinking = None
        if self._reasoning is not None and req.messages is not None:
            end = self.tokenizer.decode(prompts[0][-16:], skip_special_tokens=False)
            thinking = self._reasoning.opens(end)
        # gpt-oss (Cohere Command) under auto with strict functions: its messages (modes)
        # held from the first (harmony.auto_grammar, cohere.auto_grammar), split as ever
        own_strict = (
            (self._harmony or self._cohere is not None) and use is not None and use.kind == "auto"
            and req.constraint is None and any(t.function.strict for t in req.tools or ())
        )  # fmt: skip
        budgets = self._budgets(req, prompts, thinking)
        if isinstance(budgets, PrepareError):
            return budgets
        try:  # nothing generated (max_new_tokens 0): nothing to constrain
            constrained = self._constraint(req, own_calls, thinking) if wanted else None
        except PrepareError as exc:
            return exc
        if constrained is not None:
            compiling = constrained
            if compiling.done():  # compiled before (or here): refused now if it failed
                try:
                    constraint, compiling = compiling.result(), None
                except GrammarError as exc:
                    return PrepareError(str(exc))
        bias = {int(k): b for k, b in (req.logit_bias or {}).items()}
        think_end = None if own_calls or own_strict else self._think_end
        reasoning = (
            self._reasoning is not None
            and req.messages is not None
            and (constrained is None or thinking is False or think_end is not None
                 or own_calls or own_strict)
        )  # fmt: skip
        allowed = tuple(sorted(set(req.allowed_token_ids or ())))
        for name, ids in (("stop_token_ids", req.stop_token_ids or ()), ("logit_bias", bias),
                          ("allowed_token_ids", allowed)):  # fmt: skip
            unknown = sorted(t for t in ids if t >= self.vocab_size)
            if unknown:
                return PrepareError(f"{name} {unknown[:8]} are not tokens of this model "
                                    f"(vocabulary {self.vocab_size})")  # fmt: skip
        spec = GenSpec(
            prompts=tuple(tuple(p) for p in prompts),
            max_new_tokens=tuple(min(wanted, self.context - len(p)) for p in prompts),
            sampling=Sampling(
                req.temperature or 0.0,
                req.top_p if req.top_p is not None else 1.0,
                req.top_k or 0,
                req.seed,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                min_new_tokens=at_least,
                logit_bias=tuple(sorted(bias.items())),
                ignore_eos=bool(req.ignore_eos),
                min_p=req.min_p or 0.0,
                logprobs=req.logprobs,
                constraint=constraint,
                allowed_tokens=allowed,
                bad_words=self._bad_words(req.bad_words or ()),
                constraint_after=think_end
                if reasoning and constrained is not None and thinking is not False
                else None,
                constraint_unless=self._think_open
                if reasoning and constrained is not None and thinking is None
                else None,
            ),
            stop=tuple(req.stop or ()),
            stream=bool(req.stream),
            stop_ids=frozenset(req.stop_token_ids or ()),
            n=req.n or 1,
            keep_stop=bool(req.include_stop_str_in_output),
            prompt_logprobs=req.prompt_logprobs,
            tools=use,
            reasoning=reasoning,
            thinking=thinking,
            tool_types=param_types(req.tools)
            if req.tools
            and (
                self._blocks is not None
                or ALIASES.get(self._calls_parser or "", self._calls_parser) in TYPED_ARGS
            )
            else {},
            skip_special=req.skip_special_tokens is not False,
            token_ids=bool(req.return_token_ids),
            cache_salt=req.cache_salt,
            prompt_texts=tuple(
                t if t is not None else self.tokenizer.decode(p, skip_special_tokens=False)
                for t, p in zip(texts, prompts, strict=True)
            )
            if req.return_prompt_text
            else None,
            token_strs=bool(req.return_token_strs),
            compiling=compiling,
            lora=lora,
            lora_name=req.lora,
            beam=bool(req.use_beam_search),
            length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
            budgets=budgets,
        )
        lengths = tuple(len(p) for p in prompts for _ in range(spec.n))
        # the KV cache holds per sequence its prompt, or nothing where it is answered when
        # admitted (nothing to generate, nor to score)
        scored = req.prompt_logprobs is not None  # the first completion of each prompt
        held = tuple(len(p) if wanted or (scored and j == 0) else 0
                     for p in prompts for j in range(spec.n))  # fmt: skip
        return Prepared(spec, rows=len(lengths), tokens=max(lengths), prompts=held,
                        max_new_tokens=max(spec.max_new_tokens))  # fmt: skip

    def _capped(self, tokens: int) -> int:
        """``tokens`` cut to :attr:`new_tokens_cap` (vLLM's ``get_max_tokens`` takes the
        least of a request's ``max_tokens`` and the ``override_max_tokens``)."""
        cap = self.new_tokens_cap
        return tokens if cap is None else min(tokens, cap)

    def _budgets(self, req: Request, prompts: Sequence[Sequence[int]],
                 thinking: bool | None) -> tuple[ThinkBudget, ...] | PrepareError:  # fmt: skip
        """Per prompt, its ``thinking_token_budget`` (empty: none asked). A prompt whose
        tokens leave the reasoning open begins in it, those tokens counted (vLLM's); else a
        chat's text begins in its reasoning as its split tells (``thinking``), a prompt's
        (or a chat's to a model without a reasoning parser) as its end's markers tell; a
        text not begun in it opens it with an opening tag the model writes."""
        budget, marks = req.thinking_token_budget, self._markers
        if budget is None:
            return ()
        if marks is None:
            return PrepareError("thinking_token_budget: this model has no reasoning markers "
                                "(options.reasoning_parser with tags, or "
                                "options.reasoning_config)")  # fmt: skip
        if req.messages is not None and self._reasoning is not None:
            return tuple(marks.budget(budget, thinking, p) for p in prompts)
        return tuple(
            marks.budget(budget, marks.opens(self.tokenizer.decode(list(p[-16:]),
                                                                   skip_special_tokens=False)), p)
            for p in prompts
        )  # fmt: skip

    def _bad_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens as written alone and after a space (vLLM's ``bad_words``)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return tuple(out)

    def _constraint(
        self, req: Request, own_calls: bool = False, thinking: bool | None = None
    ) -> Future[Constraint] | None:
        """The request's ``structured_outputs`` (or ``response_format``, or the calls
        its ``tool_choice`` asks for; ``own_calls``: as gpt-oss or Cohere Command writes
        them, ``thinking`` telling where Command's text begins; or, for ``auto`` with
        ``strict`` functions, the calls in the model's format), compiled for this
        tokenizer or being compiled (:meth:`Grammars.submit`); None: the text is free."""
        spec = req.constraint
        use = req.tool_use
        grammar: str | None = None
        if own_calls and self._blocks is not None:
            return None  # written natively, read as auto (as vLLM's parsers take them)
        if own_calls:
            assert use is not None and req.tools is not None
            fns = called(req.tools, use)
            fmt = self._cohere
            grammar = (
                harmony.calls_grammar(fns)
                if fmt is None
                else cohere.calls_grammar(fmt, cohere.begins(fmt, thinking), fns, use.parallel)
            )
        elif spec is not None and spec.structural_tag is not None:
            grammars = self._grammars
            if isinstance(grammars, str):
                raise PrepareError(f"structural_tag: {grammars}")
            grammar = struct_tag.grammar(spec.structural_tag, grammars.token)
        elif spec is None and use is not None and use.kind == "auto" and req.tools:
            if not any(t.function.strict for t in req.tools):
                return None
            grammars = self._grammars
            if isinstance(grammars, str):
                raise PrepareError(f"strict functions: {grammars}")
            parser = ALIASES.get(self._calls_parser or "", self._calls_parser)
            functions = [(t.function.name, t.function.parameters, bool(t.function.strict))
                         for t in req.tools]  # fmt: skip
            if self._harmony:
                grammar = harmony.auto_grammar(functions)
            elif self._cohere is not None:  # its markers special tokens, else not enforced
                held = all(grammars.token(m) is not None for m in self._cohere.tokens)
                grammar = (
                    cohere.auto_grammar(self._cohere, functions, use.parallel) if held else None
                )
            else:
                grammar = strict_calls.grammar(
                    parser or "", functions, use.parallel, grammars.token
                )
            if grammar is None:
                return None  # a format the grammars do not hold: strict not enforced
        if grammar is not None:
            spec = StructuredOutputs.model_construct(grammar=grammar)  # tools are bounded
        if spec is None:
            return None
        if req.ignore_eos:
            raise PrepareError("structured_outputs ends the text with an end-of-sequence "
                               "token: it does not go with ignore_eos")  # fmt: skip
        grammars = self._grammars
        if isinstance(grammars, str):
            raise PrepareError(grammars)
        try:
            return grammars.submit(spec)
        except GrammarError as exc:
            raise PrepareError(str(exc)) from exc
