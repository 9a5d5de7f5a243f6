"""Speculation bounded by the batch's size: vLLM's ``disable_by_batch_size`` and
``num_speculative_tokens_per_batch_size`` (:class:`BatchBound`).

Verifying drafts widens every decoding row's forward, which pays while a few rows run
and costs throughput once many do. Both keys decide, per step and for the whole batch,
how many drafts a row may propose from how many sequences run in that step:

- ``disable_by_batch_size = N`` (vLLM V0's ``SpecDecodeWorker``): no row proposes in a
  step where ``N`` or more sequences run (vLLM compares ``running_queue_size >= N``,
  though its docstring says "larger than"; ``N`` is at least 2, as vLLM checks). vLLM V0
  also never let a sequence speculate again once it had skipped a step, because its
  draft's KV cache had fallen behind; here the draft model lines its cache up with the
  row's context whenever it next proposes (:mod:`.draft`), so every row speculates again
  once the batch is smaller. vLLM V1 accepted the key but never applied it, and removed
  it (vllm-project/vllm#35060) for the next one.
- ``num_speculative_tokens_per_batch_size = [[lo, hi, k], ...]`` (vLLM V1's dynamic
  speculative decoding, vllm-project/vllm#32374): in a step where ``lo`` … ``hi``
  sequences run, rows propose at most ``k`` drafts (0: none); a batch size between two
  ranges takes the range before it, one past the last range the last, and ``k`` above
  ``num_speculative_tokens`` is that. Ranges are inclusive, do not overlap, and the first
  starts at 1, as vLLM checks; its five-item form (context-length ranges too) is refused.

The running count is vLLM V1's: its scheduler looks ``k`` up by the requests a step
schedules (``len(num_scheduled_tokens)``: decodes, and prefill chunks whether the prefill
ends in the step or not) and hands it to the drafter, which proposes at the step's end
the drafts the next step verifies. The padded engine proposes at a step's start, so its
rows propose by the sequences the step before ran (:attr:`.PaddedEngine.batch_size`): its
decode rows (those that finished in it too), the sequences its prefill chunks ran for
(those that began in it too, and those that ended at once), and the twins waiting on
those prefills (a request's ``n`` completions, each a request of its own to vLLM) up to
``max_running``. A request still queued, or added since, does not count: the step whose
prefill begins it counts it for the next step's drafts, as vLLM's does. vLLM V0
compared its running queue in the step it proposed for; here both keys read V1's count.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

WHERE = "options.speculative"
KEYS = ("disable_by_batch_size", "num_speculative_tokens_per_batch_size")

Range = tuple[int, int, int]
"""(First batch size, last batch size, drafts a row may propose)."""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class BatchBound:
    """How many drafts a row may propose in a step, by the step's running count (module
    docstring); neither key set: ``num_speculative_tokens`` always."""

    disable_by_batch_size: int | None = None
    """No drafts in a step where at least this many sequences run."""
    num_speculative_tokens_per_batch_size: tuple[Range, ...] | None = None
    """Per range of running counts (sorted), the most drafts a row proposes."""

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> BatchBound:
        """The two keys of ``options.speculative``, checked (a ``ValueError`` says what is
        wrong)."""
        n = raw.get("disable_by_batch_size")
        table = raw.get("num_speculative_tokens_per_batch_size")
        if n is not None and table is not None:
            raise ValueError(f"{WHERE}: disable_by_batch_size and "
                             "num_speculative_tokens_per_batch_size both bound speculation by "
                             "the batch's size: give one (a range with k = 0 turns it off)")  # fmt: skip
        if n is not None and not (_int(n) and n >= 2):
            raise ValueError(f"{WHERE}.disable_by_batch_size: {n!r} is not an integer of "
                             "at least 2 (vLLM's bound)")  # fmt: skip
        return cls(n, None if table is None else _ranges(table))

    def limit(self, running: int, k: int) -> int:
        """The most drafts a row may propose in a step where ``running`` sequences run,
        given ``num_speculative_tokens`` ``k`` (0: none)."""
        if self.disable_by_batch_size is not None and running >= self.disable_by_batch_size:
            return 0
        if self.num_speculative_tokens_per_batch_size is None:
            return k
        most = k
        for low, _, drafts in self.num_speculative_tokens_per_batch_size:
            if low > running:
                break
            most = drafts  # the range holding ``running``, or the last before it
        return min(k, most)

    def settings(self) -> dict[str, Any]:
        """The keys set, as ``info()`` shows them."""
        out: dict[str, Any] = {}
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        if self.num_speculative_tokens_per_batch_size is not None:
            out["num_speculative_tokens_per_batch_size"] = [
                list(r) for r in self.num_speculative_tokens_per_batch_size
            ]
        return out


def _ranges(table: Any) -> tuple[Range, ...]:
    """``num_speculative_tokens_per_batch_size`` checked as vLLM checks it, sorted."""
    where = f"{WHERE}.num_speculative_tokens_per_batch_size"
    if not isinstance(table, list | tuple) or not table:
        raise ValueError(f"{where}: a non-empty list of [first, last, k] batch-size ranges, "
                         "such as [[1, 8, 4], [9, 1024, 0]]")  # fmt: skip
    out: list[Range] = []
    for entry in table:
        if isinstance(entry, list | tuple) and len(entry) == 5:
            raise ValueError(f"{where}: {list(entry)!r}: the five-item form (context-length "
                             "ranges) is not served; give [first, last, k]")  # fmt: skip
        if not (isinstance(entry, list | tuple) and len(entry) == 3 and all(map(_int, entry))):
            raise ValueError(f"{where}: {entry!r} is not [first, last, k] (three integers)")
        low, high, k = entry
        if low <= 0 or high < low or k < 0:
            raise ValueError(f"{where}: {list(entry)!r}: the batch sizes must be positive, "
                             "first <= last, and k at least 0")  # fmt: skip
        out.append((low, high, k))
    out.sort()
    if out[0][0] != 1:
        raise ValueError(f"{where}: the first range must start at 1, so every batch size has "
                         f"a bound (it starts at {out[0][0]})")  # fmt: skip
    for (_, high, _), (low, _, _) in itertools.pairwise(out):
        if low <= high:
            raise ValueError(f"{where}: the ranges overlap at batch size {low}")
    return tuple(out)


NO_BOUND = BatchBound()
"""Neither key set: every step's rows may propose ``num_speculative_tokens``."""
