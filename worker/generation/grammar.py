"""Structured outputs: a request's JSON schema, regex, choices or grammar, as a token mask.

llguidance (the Rust library behind vLLM's ``guidance`` backend) compiles a constraint
for one tokenizer and, per sequence, a matcher: at each step it says which tokens may come
next (a bitmask over the vocabulary, about 0.1 ms for SmolLM2's 49,152 tokens) and
consumes the token drawn. Once the constraint is complete and nothing may follow, only the
end-of-sequence tokens are allowed, so the sequence ends with ``finish_reason`` ``stop``.

:class:`Grammars` (one per runner) compiles requests' constraints and keeps the last few
compiled, so a schema sent again is not compiled again. A :class:`Constraint` makes a
fresh matcher per sequence; the sampler (``sampling.py``) owns the matchers.

Compiling takes from about a millisecond (one tool's schema, SmolLM2's 49,152 tokens) to
some 40 ms (a 64 KB schema of 59 objects), llguidance's own work with the GIL released.
On the loop thread that long, the device, one step queued ahead, ran dry on a GPU (a
step there takes a few ms). So with ``threads`` (the runner's ``compile_threads``) a
schema not compiled yet is compiled on a thread of its own (:meth:`Grammars.submit`),
vLLM's way: the request waits for it, admitted, while the others run, and one llguidance
refuses fails then.
With no threads each is compiled when the request is read, as before.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import struct_tag

if TYPE_CHECKING:
    import llguidance

    from ...schemas.messages import StructuredOutputs

_CACHED = 64
"""Compiled constraints kept (least recently used goes)."""


class GrammarError(ValueError):
    """A constraint llguidance cannot compile (its message says where)."""


class Constraint:
    """One compiled constraint; :meth:`matcher` gives each sequence its own state."""

    __slots__ = ("_proto", "kind", "vocab_size")

    def __init__(self, proto: llguidance.LLMatcher, kind: str, vocab_size: int) -> None:
        self._proto = proto
        self.kind = kind
        self.vocab_size = vocab_size
        """The tokens its masks cover (the model's logits width)."""

    def matcher(self) -> llguidance.LLMatcher:
        """A matcher at the start of the text (a copy: compiled once)."""
        return self._proto.deep_copy()


class Grammars:
    """Compiles requests' ``structured_outputs`` for one tokenizer (see the module
    docstring). ``vocab_size``: the model's logits width (may exceed the tokenizer's)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], threads: int = 0
    ) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self._hf = tokenizer
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, Future[Constraint]] = OrderedDict()
        """Compiled (or compiling) constraints by their spec, the last used last. Only the
        loop thread reads and writes it; the pool's threads only compile."""
        self._pool = ThreadPoolExecutor(threads, "bf-grammar") if threads > 0 else None
        self.took: deque[float] = deque(maxlen=1024)
        """Seconds each compile took (refused ones too), for the metrics; the runner
        takes them (a deque: the compiling threads append, the device thread pops)."""
        self._tokens: dict[str, str | None] = {}

    def token(self, marker: str) -> str | None:
        """How a grammar names ``marker`` where this tokenizer makes it a special token
        (``<|name|>``; ``<[id]>`` for a ``[NAME]`` one, Mistral's); free text cannot write
        it. None: the marker is text. Asked once per marker (the loop thread's)."""
        if marker in self._tokens:
            return self._tokens[marker]
        got: str | None = None
        if marker.startswith("<") and marker.endswith(">") and "\n" not in marker:
            ll = self._ll.LLMatcher
            probe = ll(self.tokenizer, ll.grammar_from_lark(f"start: {marker}"), log_level=0)
            got = None if probe.is_error() else marker
        elif marker.startswith("[") and marker.endswith("]"):
            ids = self._hf.encode(marker, add_special_tokens=False)
            added = getattr(self._hf, "added_tokens_decoder", {})
            if len(ids) == 1 and getattr(added.get(ids[0]), "special", False):
                got = f"<[{int(ids[0])}]>"
        self._tokens[marker] = got
        return got

    def compile(self, spec: StructuredOutputs) -> Constraint:
        """``spec`` compiled (or the copy compiled last time), here and now;
        :class:`GrammarError` if llguidance refuses it."""
        return self.submit(spec, here=True).result()

    def submit(self, spec: StructuredOutputs, here: bool = False) -> Future[Constraint]:
        """``spec`` compiled, or being compiled on a thread of the pool (``here``, or no
        pool: compiled now, on this thread); one llguidance refuses raises
        :class:`GrammarError` from the future."""
        key = json.dumps(spec.model_dump(mode="json", exclude_none=True), sort_keys=True)
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            return hit
        if here or self._pool is None:
            done: Future[Constraint] = Future()
            try:
                done.set_result(self._compile(spec))
            except GrammarError as exc:
                done.set_exception(exc)
            fut = done
        else:
            fut = self._pool.submit(self._compile, spec)
        self._compiled[key] = fut
        if len(self._compiled) > _CACHED:
            self._compiled.popitem(last=False)
        return fut

    def close(self) -> None:
        """Stop the pool (compiles under way are left to end)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputs) -> Constraint:
        kind = spec.kind
        began = time.perf_counter()
        try:
            matcher = self._ll.LLMatcher(self.tokenizer, self._grammar(spec), log_level=0)
        finally:
            self.took.append(time.perf_counter() - began)
        if matcher.is_error():
            raise GrammarError(f"structured_outputs.{kind}: {_first_lines(matcher.get_error())}")
        return Constraint(matcher, kind, self.vocab_size)

    def _grammar(self, spec: StructuredOutputs) -> str:
        ll = self._ll.LLMatcher
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                schema: Any = {"type": "object"} if kind == "json_object" else spec.json_schema
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict | bool):
                    raise GrammarError("structured_outputs.json: a JSON Schema is an object")
                if spec.disable_additional_properties and isinstance(schema, dict):
                    schema = _closed(schema)
                options: dict[str, Any] = {}
                if spec.disable_any_whitespace:
                    options["whitespace_flexible"] = False
                if spec.whitespace_pattern is not None:
                    options["whitespace_pattern"] = spec.whitespace_pattern
                return ll.grammar_from_json_schema(schema, overrides=options or None)  # type: ignore[arg-type]
            if kind == "regex":
                assert spec.regex is not None
                return ll.grammar_from_regex(spec.regex)
            if kind == "choice":
                assert spec.choice is not None
                return self._ll.grammar_from("choice", json.dumps(spec.choice))
            if kind == "structural_tag":  # (the runner builds it on its thread first)
                assert spec.structural_tag is not None
                return self._ll.grammar_from(
                    "lark", struct_tag.grammar(spec.structural_tag, self.token)
                )
            assert spec.grammar is not None
            return self._ll.grammar_from("grammar", spec.grammar)
        except GrammarError:
            raise
        except (ValueError, TypeError) as exc:  # bad JSON text, a GBNF it cannot convert
            raise GrammarError(f"structured_outputs.{kind}: {_first_lines(str(exc))}") from exc


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``additionalProperties: false`` on every object schema in it that
    lists ``properties`` and does not say (vLLM's ``disable_additional_properties``)."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out

    closed: dict[str, Any] = walk(schema)
    return closed


def _first_lines(message: str, lines: int = 6) -> str:
    return "\n".join(message.strip().splitlines()[:lines])


class Masks:
    """Bitmasks that matchers fill, read as which tokens each allows next; several
    matchers' are filled at once on llguidance's threads (the GIL released)."""

    def __init__(self, vocab_size: int) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._buffer = np.zeros((0, self._words), dtype=np.int32)
        self._executor: llguidance.LLExecutor | None = None
        self._ll = llguidance

    def allowed(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """Per matcher, the tokens it allows next (bool, ``len(matchers)`` x ``vocab_size``)."""
        n = len(matchers)
        if self._buffer.shape[0] < n:
            self._buffer = np.zeros((max(n, 2 * self._buffer.shape[0]), self._words), np.int32)
        words = self._buffer[:n]
        row = self._words * 4
        if n == 1:
            matchers[0].unsafe_compute_mask_ptr(words.ctypes.data, row)
        else:
            if self._executor is None:
                self._executor = self._ll.LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                                   words.ctypes.data, row, n)  # fmt: skip
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, : self.vocab_size].view(np.bool_))
