"""A stream's deltas matched against a restarted generation's (shared by every streamed
answer: chat and text chunks, Responses API events).

When the worker generating a request dies, another generates it again from the start
(:class:`~batchfleet.producer.tokens.Restarted`): what was already sent cannot be taken
back, so each output's regenerated deltas are skipped while they are the ones sent (a
greedy or seeded request regenerates the same tokens); the first that differs ends the
stream (:class:`Diverged`); past them the stream goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...schemas.messages import Delta


class Diverged(Exception):
    """A restarted generation wrote other text than the one already streamed."""


@dataclass
class _Sent:
    texts: list[str] = field(default_factory=list)
    """The text of each delta sent (to match a regeneration against)."""
    replayed: int = 0
    """Deltas matched since the last restart."""


class Replay:
    """Which deltas of one stream are new (to send) and which repeat what was sent."""

    def __init__(self) -> None:
        self.outputs: dict[int, _Sent] = {}
        self.restarted = False

    def restart(self) -> None:
        """Another worker begins again: its deltas are matched against those sent."""
        self.restarted = True
        for sent in self.outputs.values():
            sent.replayed = 0

    def fresh(self, delta: Delta) -> bool:
        """True for a delta to send, False for one that repeats a delta sent;
        :class:`Diverged` where a regeneration differs from what was sent."""
        sent = self.outputs.get(delta.input)
        if sent is None:  # (not setdefault: it would make a _Sent a delta)
            sent = self.outputs[delta.input] = _Sent()
        if self.restarted and sent.replayed < len(sent.texts):
            if sent.texts[sent.replayed] != delta.text:
                raise Diverged(
                    "the worker generating this request stopped, and another generated other "
                    "text than the one already streamed (sample with a seed to have it the same)"
                )
            sent.replayed += 1
            return False
        sent.texts.append(delta.text)
        sent.replayed = len(sent.texts)
        return True
