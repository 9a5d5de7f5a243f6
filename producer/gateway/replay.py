"""Which deltas of one stream are new to its client, across a worker's restart.

When the worker generating a streamed request dies, another generates it again from the
start (:class:`~batchfleet.producer.tokens.Restarted`). What was sent cannot be taken
back, so each output's regenerated deltas are matched against the ones sent and skipped
while they are the same (a greedy or seeded request regenerates the same tokens); the
first that differs ends the stream (:class:`Diverged`); past them the stream goes on.
Every streamed answer (OpenAI's chunks, Anthropic's events) keeps one :class:`Replay`.
"""

from __future__ import annotations

from ...producer.tokens import Restarted
from ...schemas.messages import Delta


class Diverged(Exception):
    """A restarted generation wrote other text than the one already streamed."""


class Replay:
    """The text of each delta sent, per output, and how far a regeneration matched it."""

    def __init__(self) -> None:
        self.sent: dict[int, list[str]] = {}
        self.replayed: dict[int, int] = {}
        """Per output: its deltas matched since the last restart."""

    def new(self, event: Delta | Restarted) -> Delta | None:
        """The delta to send, or None: a :class:`Restarted` (the generation begins again:
        its next deltas are matched from the first), or a regenerated delta already sent;
        :class:`Diverged` where it differs from the one sent in its place."""
        if isinstance(event, Restarted):
            self.replayed = dict.fromkeys(self.sent, 0)
            return None
        delta = event
        sent = self.sent.setdefault(delta.input, [])
        matched = self.replayed.get(delta.input, len(sent))
        if matched < len(sent):
            if sent[matched] != delta.text:
                raise Diverged(
                    "the worker generating this request stopped, and another generated other "
                    "text than the one already streamed (sample with a seed to have it the same)"
                )
            self.replayed[delta.input] = matched + 1
            return None
        sent.append(delta.text)
        self.replayed[delta.input] = len(sent)
        return delta
