"""The inter-token histogram's tally of a step's gaps (worker/token_gaps.py)."""

from __future__ import annotations

import random
from collections import Counter

from batchfleet.worker.token_gaps import TokenGaps, tally


def test_a_steps_gaps_are_counted_once_for_both_histograms() -> None:
    # Given a step's gaps (a tuple, as the loop's Generated event carries them)
    gaps = ((1, 0.02), (1, 0.02), (2, 0.03), (1, 0.02))
    # When two histograms take them, as batchfleet's and vLLM's do
    first, second = tally(gaps), tally(gaps)
    # Then the second got the first's count, and the count is right
    assert second is first
    assert first == Counter({(1, 0.02): 3, (2, 0.03): 1})


def test_a_list_changed_in_place_is_counted_again() -> None:
    gaps = [(1, 0.02)]
    assert tally(gaps) == Counter({(1, 0.02): 1})
    gaps.append((1, 0.02))
    assert tally(gaps) == Counter({(1, 0.02): 2})


def test_two_histograms_fed_the_same_steps_equal_one_observation_per_gap() -> None:
    # Given random steps of gaps, each fed to two histograms (one by lane, one series)
    rng = random.Random(7)
    by_lane, one = TokenGaps(), TokenGaps("other")
    expected: Counter[tuple[str, float]] = Counter()
    for _ in range(50):
        gaps = tuple((rng.randrange(3), rng.choice((0.004, 0.02, 0.3, 7.0)))
                     for _ in range(rng.randrange(9)))  # fmt: skip
        by_lane.add("m", gaps)
        one.add_to(("m", "all"), gaps)
        expected.update((str(lane), s) for lane, s in gaps)

    # Then each series counts every gap once, in its bucket, with its sum
    def series(h: TokenGaps) -> dict[tuple[str, ...], tuple[list[int], float]]:
        return {k: (list(c), t[0]) for k, (c, t) in h._series.items()}

    for lane in "012":
        counts, total = series(by_lane)[("m", lane)]
        mine = {s: n for (ln, s), n in expected.items() if ln == lane}
        assert sum(counts) == sum(mine.values())
        assert abs(total - sum(s * n for s, n in mine.items())) < 1e-9
    counts, total = series(one)[("m", "all")]
    assert sum(counts) == sum(expected.values())
    assert counts[-1] == sum(n for (_, s), n in expected.items() if s > 5)
