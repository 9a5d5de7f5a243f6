"""A cap on a sequence's reasoning tokens (vLLM's ``thinking_token_budget``).

Once a sequence's reasoning holds ``budget`` tokens, the engine forces the end-of-reasoning
tokens (``</think>``, one per step, overriding the pick) and the text goes on with its
answer; 0 ends the reasoning as soon as it opens. Where the reasoning is follows vLLM's
``ThinkingBudgetStateHolder`` (``vllm/v1/sample/thinking_budget_state.py``):

- a prompt whose last opening tag comes after its last end tag (by tokens) opened it, and
  its tokens after that tag count (:func:`prompt_open`): a prompt ending ``<think>\n`` has
  spent its newline's tokens of the budget, one holding ``budget`` tokens there or more has
  the end forced from the first generated token; every generated token counts from there,
  an opening tag the model writes too (vLLM looks for none once the prompt opened it);
- else (the prompt closed it, or shows no tag) the first opening tag the model writes,
  wherever in its text, opens it, and the tokens after that tag count (vLLM watches the
  generated tokens for it); before one, nothing is counted or forced;
- one difference, kept on purpose: where the reasoning split says the text begins in its
  reasoning with no tag in the prompt (``thinking`` true: DeepSeek-R1's parser, whose
  reasoning needs no opening tag), the count starts at the first generated token, as the
  split reports that text as reasoning (vLLM, seeing no tag, forces nothing: the budget
  has no effect); a leading opening tag the model writes restarts it (where vLLM's
  count would start).

The reasoning's end tag, or one of the markers that end it as well (a tool-call section's,
:data:`~.reasoning.ENDS`), written by the model ends it with no forcing; once ended it does
not open again (vLLM's state machine takes one opening and one end).

:class:`BudgetState` is a pure function of the rule (the prompt's part included) and the
tokens generated (:meth:`BudgetState.replay`), so a sequence preempted and recomputed, or
reclaimed by another worker (which prepares the same prompt again), counts the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final


@dataclass(frozen=True, slots=True)
class ThinkBudget:
    """A request's budget and the tokens of its model's reasoning markers."""

    budget: int
    """Reasoning tokens allowed before the end is forced (0: none)."""
    end: tuple[int, ...]
    """The end tag's tokens (forced, one per step); never empty."""
    start: tuple[int, ...] = ()
    """The opening tag's tokens (empty: the model has none)."""
    thinking: bool | None = None
    """The text begins in its reasoning (True: the prompt's tokens left it open, or the
    split says so), or not (False: the prompt closed it; None: no word): then an opening
    tag the model writes opens it."""
    enders: tuple[tuple[int, ...], ...] = ()
    """Other token sequences that end the reasoning when the model writes them."""
    prior: int | None = None
    """Reasoning tokens the prompt already holds (after its last opening tag; vLLM counts
    them): what is left of the budget for the text is ``budget - prior``. None: the
    prompt's tokens did not open it (``thinking`` true: the split's word alone)."""

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"thinking_token_budget {self.budget} < 0")
        if self.prior is not None and self.prior < 0:
            raise ValueError(f"a prompt's reasoning tokens {self.prior} < 0")
        if self.prior is not None and self.thinking is not True:
            raise ValueError("a prompt's reasoning tokens count only where it opened it")
        if not self.end:
            raise ValueError("a thinking budget needs the end tag's tokens")


class Phase(Enum):
    """Where a sequence stands in its reasoning."""

    WATCHING = "watching"
    """Not in its reasoning yet: an opening tag the model writes opens it."""
    THINKING = "thinking"
    """In its reasoning, counting."""
    FORCING = "forcing"
    """Its budget spent: the end tag's tokens are forced."""
    DONE = "done"
    """Its reasoning ended (it does not open again), or cannot begin (the model has no
    opening tag): nothing more to do."""


@dataclass(slots=True)
class BudgetState:
    """One sequence's progress through its budget (feed it each generated token)."""

    rule: ThinkBudget
    phase: Phase = Phase.DONE
    taken: int = 0
    """Tokens generated so far."""
    count: int = 0
    """Reasoning tokens counted so far."""
    lead: int = 0
    """How many leading tokens match the opening tag (opened by the split's word alone:
    not counted once they make it whole)."""
    at: int = 0
    """While forcing: the index of the end tag's next token."""
    tail: list[int] = field(default_factory=list)
    """The last tokens (as many as the longest marker), to spot a marker's end."""

    @classmethod
    def begin(cls, rule: ThinkBudget) -> BudgetState:
        """The state before the first generated token."""
        state = cls(rule)
        if rule.thinking is True:
            state._think(rule.prior or 0)
        elif rule.start:
            state.phase = Phase.WATCHING
        return state

    @classmethod
    def replay(cls, rule: ThinkBudget, out: Iterable[int]) -> BudgetState:
        """The state after generating ``out`` (a resume: its output as the engine has it)."""
        state = cls.begin(rule)
        for token in out:
            state.took(token)
        return state

    def forced(self) -> int | None:
        """The token the sequence must take next (None: its own pick)."""
        return self.rule.end[self.at] if self.phase is Phase.FORCING else None

    def took(self, token: int) -> None:
        """The sequence generated ``token`` (forced or its own)."""
        rule = self.rule
        self.taken += 1
        self.tail.append(token)
        del self.tail[: len(self.tail) - self._span()]
        if self.phase is Phase.WATCHING:
            if _ends_with(self.tail, rule.start):
                self._think()
        elif self.phase is Phase.THINKING:
            self.count += 1
            start = rule.start
            if (rule.prior is None and self.lead == self.taken - 1 and self.lead < len(start)
                    and start[self.lead] == token):  # fmt: skip
                self.lead += 1
                if self.lead == len(start):  # a leading opening tag: not reasoning
                    self.count = 0
            if self._ended():
                self.phase = Phase.DONE
            elif self.count >= rule.budget:
                self._force()
        elif self.phase is Phase.FORCING:
            self.at = self.at + 1 if token == rule.end[self.at] else self._begun()
            if self.at == len(rule.end):
                self.phase = Phase.DONE

    def _think(self, count: int = 0) -> None:
        """In its reasoning, ``count`` tokens of it already (the prompt's)."""
        self.phase = Phase.THINKING
        self.count = count
        if count >= self.rule.budget:
            self._force()

    def _force(self) -> None:
        """Spent: force the end tag, from where the text may already have begun it."""
        self.phase = Phase.FORCING
        self.at = self._begun()

    def _begun(self) -> int:
        """How many of the end tag's first tokens the text ends with (short of all)."""
        end, tail = self.rule.end, self.tail
        for n in range(min(len(end) - 1, len(tail)), 0, -1):
            if tail[-n:] == list(end[:n]):
                return n
        return 0

    def _ended(self) -> bool:
        """The text ends with the end tag or another marker that ends the reasoning."""
        return any(_ends_with(self.tail, m) for m in (self.rule.end, *self.rule.enders))

    def _span(self) -> int:
        return max(len(m) for m in (self.rule.start, self.rule.end, *self.rule.enders))


def _ends_with(tail: Sequence[int], marker: Sequence[int]) -> bool:
    """``tail`` ends with ``marker``'s tokens (an empty marker: never)."""
    n = len(marker)
    return 0 < n <= len(tail) and list(tail[-n:]) == list(marker)


def opens(prompt_end: str, start: str, end: str) -> bool | None:
    """Whether a text after a prompt ending ``prompt_end`` begins in its reasoning, read
    off its markers alone (a completion's prompt, or a model without a reasoning parser):
    it does after an opening tag, not after an end tag; None: no word (either way, an
    opening tag the model writes then opens it)."""
    tail = prompt_end.rstrip()
    if start and tail.endswith(start):
        return True
    if tail.endswith(end):
        return False
    return None


def prompt_open(prompt: Sequence[int], start: Sequence[int], end: Sequence[int]) -> int | None:
    """How many of ``prompt``'s tokens follow its last opening tag (``start``'s tokens)
    where no end tag (``end``'s) follows that tag; None where none is open (no opening tag,
    or the prompt closed it). vLLM's ``_init_state_entry`` counts these into the budget."""
    opened = _last(prompt, start)
    if opened < 0 or _last(prompt[opened + 1 :], end) >= 0:
        return None
    return len(prompt) - opened - len(start)


def _last(seq: Sequence[int], sub: Sequence[int]) -> int:
    """Where ``sub`` last begins in ``seq`` (-1: nowhere, or ``sub`` empty)."""
    if not sub:
        return -1
    n, first, want = len(sub), sub[0], tuple(sub)
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == first and tuple(seq[i : i + n]) == want:
            return i
    return -1


CONFIG_KEYS: Final = ("reasoning_start_str", "reasoning_end_str")
"""The keys of a model's ``reasoning_config`` option (vLLM's ``--reasoning-config``)."""


@dataclass(frozen=True, slots=True)
class Markers:
    """A model's reasoning markers as text and as tokens (what a budget needs)."""

    start_str: str
    end_str: str
    start: tuple[int, ...]
    end: tuple[int, ...]
    enders: tuple[tuple[int, ...], ...] = ()

    def budget(self, budget: int, thinking: bool | None,
               prompt: Sequence[int] = ()) -> ThinkBudget:  # fmt: skip
        """A request's budget for a text after ``prompt``: begun in its reasoning, with its
        tokens there, where the prompt's tokens left it open (:func:`prompt_open`); else
        as ``thinking`` (the split's word) tells (true: from the first token; else from an
        opening tag the model writes)."""
        held = prompt_open(prompt, self.start, self.end)
        if held is not None:
            return ThinkBudget(budget, self.end, self.start, True, self.enders, held)
        return ThinkBudget(budget, self.end, self.start, thinking, self.enders)

    def opens(self, prompt_end: str) -> bool | None:
        """:func:`opens` by these markers."""
        return opens(prompt_end, self.start_str, self.end_str)


def markers(config: Any, tags: tuple[str, str] | None, enders: tuple[str, ...],
            encode: Callable[[str], list[int]]) -> Markers | None:  # fmt: skip
    """A model's markers: its ``reasoning_config`` option (a table of
    :data:`CONFIG_KEYS`), else its reasoning parser's tags (``tags``: opening, closing;
    None: no parser) and the markers that end its reasoning too (``enders``), each
    tokenized by ``encode``; None where neither gives an end tag. A malformed option is
    refused."""
    if config is not None:
        if not isinstance(config, Mapping) or set(config) - set(CONFIG_KEYS):
            raise ValueError(f"options.reasoning_config: a table of {', '.join(CONFIG_KEYS)}, "
                             f"got {config!r}")  # fmt: skip
        start, end = (config.get(k, "") for k in CONFIG_KEYS)
        if not isinstance(start, str) or not isinstance(end, str) or not end:
            raise ValueError("options.reasoning_config: reasoning_start_str is a string, "
                             "reasoning_end_str a non-empty one")  # fmt: skip
    elif tags is None or not tags[1]:
        return None
    else:
        start, end = tags
    end_ids = tuple(encode(end))
    if not end_ids:
        raise ValueError(f"options.reasoning_config: {end!r} has no tokens")
    return Markers(start, end, tuple(encode(start)) if start else (), end_ids,
                   tuple(t for m in enders if (t := tuple(encode(m)))))  # fmt: skip
