"""GritLM's embeddings as vLLM's GritLM pooler makes them (``GritLMMeanPool``): the
model's states, its attention bidirectional and unwindowed, averaged over the tokens
after the instruction a prompt begins with.

GritLM's embedding prompts are ``<|user|>\\nINSTRUCTION\\n<|embed|>\\nTEXT`` or
``<|embed|>\\nTEXT``. vLLM finds the instruction in the prompt's token ids (Mistral's
SentencePiece tokens: the first ``<`` of a text is ``▁<``, a newline ``<0x0A>``):

- a prompt that does not begin with ``<s>``: no instruction (all its tokens averaged);
- one whose tokens after ``<s>`` are ``<|user|>\\n``: the instruction ends after the
  first ``\\n<|embed|>\\n``;
- else it ends after the first ``<|embed|>\\n`` (a leading one's ``▁<``);
- with neither: the instruction is ``<s>`` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import AutoConfig, AutoModel, PreTrainedModel

TOKENS = ("<s>", "▁<", "<", "|", "user", "embed", ">", "<0x0A>")
"""The vocabulary entries vLLM's patterns are made of."""


class GritInstruction:
    """Where a GritLM prompt's instruction ends, by the patterns vLLM matches."""

    def __init__(self, token_id: Callable[[str], int | None]) -> None:
        ids = {tok: token_id(tok) for tok in TOKENS}
        missing = [tok for tok, i in ids.items() if i is None]
        if missing:
            raise ValueError(
                "pooling gritlm needs GritLM's (Mistral's SentencePiece) tokenizer: its "
                f"vocabulary lacks {', '.join(missing)}"
            )
        bos, space_lt, lt, bar, user, embed, gt, newline = (int(i or 0) for i in ids.values())
        self.bos = bos
        self.user = (space_lt, bar, user, bar, gt, newline)
        self.embed = (space_lt, bar, embed, bar, gt, newline)
        self.embed_after_user = (newline, lt, bar, embed, bar, gt, newline)

    def length(self, ids: Sequence[int]) -> int:
        """How many of ``ids`` (a prompt's tokens) are its instruction, left out of the
        mean (0: none, the prompt does not begin with ``<s>``)."""
        if not ids or ids[0] != self.bos:
            return 0
        user = tuple(ids[1 : 1 + len(self.user)]) == self.user
        pattern = self.embed_after_user if user else self.embed
        at = _find(ids, pattern, 1)
        return 1 if at < 0 else at + len(pattern)


def _find(ids: Sequence[int], pattern: tuple[int, ...], start: int) -> int:
    """Where ``pattern`` first stands in ``ids`` from ``start`` on (-1: nowhere)."""
    n, first = len(pattern), pattern[0]
    for i in range(start, len(ids) - n + 1):
        if ids[i] == first and tuple(ids[i : i + n]) == pattern:
            return i
    return -1


def load_bidirectional(path: str, dtype: Any) -> PreTrainedModel:
    """A decoder's base model whose attention is bidirectional and unwindowed, as vLLM
    runs GritLM for pooling (``is_causal = False``, ``sliding_window = None``)."""
    config = AutoConfig.from_pretrained(path)
    config.is_causal = False  # transformers' masks and attention kernels read it
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None
    model: PreTrainedModel = AutoModel.from_pretrained(path, config=config, dtype=dtype)
    return model
