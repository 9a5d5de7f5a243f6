"""The generation policy preempts the sequences of a request (vLLM's child requests of
``n > 1``) one at a time: only as many as a squeeze needs, the others keep running, and
each freed one waits on its own and resumes into its request (virtual time)."""

from __future__ import annotations

import pytest
from batchfleet.batching.gen_simulator import GenRequest, simulate_generation
from batchfleet.batching.generation import GenerationPolicy
from gen_helpers import gr, gw, tokens_policy

FOUR = (0, 1, 2, 3)


def test_lane0_arrival_frees_only_the_sequences_it_needs() -> None:
    # Given a lane-1 request of four sequences of 19 tokens (20 blocks each, page 1) in a
    # 100-block cache: 20 free. When a lane-0 prompt of 29 tokens (30 blocks) comes:
    # one sequence, the last, is freed; the other three keep running.
    plan = GenerationPolicy(tokens_policy(kv=100)).plan(
        [gw("top", 1.0, prompts=(29,))],
        [gr("par", 0.0, lane=1, contexts=(19, 19, 19, 19), seqs=FOUR)],
        1.0,
    )
    assert plan.admit == ("top",)
    assert plan.preempt == ()
    assert plan.preempt_seqs == (("par", (3,)),)


def test_growth_frees_the_lowest_lane_last_sequence_only() -> None:
    # Two requests of two sequences fill 100 blocks exactly, and each sequence's next
    # token needs one more block than reserved after it grew: 101 > 100 (page 1).
    plan = GenerationPolicy(tokens_policy(kv=100)).plan(
        [],
        [
            gr("hi", 0.0, lane=1, contexts=(25, 25), seqs=(0, 1)),
            gr("lo", 0.1, lane=2, contexts=(24, 23), seqs=(0, 1)),
        ],
        1.0,
    )
    assert plan.preempt == ()
    assert plan.preempt_seqs == (("lo", (1,)),)


def test_every_sequence_needed_is_freed_each_on_its_own_not_the_request_whole() -> None:
    # (vLLM preempts each child request: each then waits and resumes on its own)
    plan = GenerationPolicy(tokens_policy(kv=100)).plan(
        [gw("top", 1.0, prompts=(89,))],  # 90 blocks: 30 short, more than one frees
        [gr("par", 0.0, lane=1, contexts=(19, 19), seqs=(0, 1))],
        1.0,
    )
    assert plan.admit == ("top",)
    assert plan.preempt == ()
    assert plan.preempt_seqs == (("par", (0, 1)),)


def test_sequences_all_freed_resume_into_their_request_one_at_a_time_as_blocks_allow() -> None:
    # Given a request whose every sequence was freed alone (it runs with none) and a
    # lane-0 request holding 50 of 100 blocks: its two sequences wait, 30 blocks each.
    # When planned: the first resumes (vLLM's child, as its blocks allow), the second
    # waits for room, not for the first to fit together with it.
    kids = [gw(f"par#{i}", 0.0, lane=1, prompts=(29,), parent="par") for i in (0, 1)]
    running = [gr("par", 0.0, lane=1, contexts=(), seqs=()), gr("top", 1.0, contexts=(49,))]
    plan = GenerationPolicy(tokens_policy(kv=100)).plan(kids, running, 2.0)
    assert plan.admit == ("par#0",)
    assert (plan.preempt, plan.preempt_seqs, plan.expire, plan.refuse) == ((), (), (), ())


def test_a_request_that_names_no_sequences_is_freed_whole() -> None:
    # (a beam search's rounds: their beams go together)
    plan = GenerationPolicy(tokens_policy(kv=100)).plan(
        [gw("top", 1.0, prompts=(29,))], [gr("beams", 0.0, lane=1, contexts=(19, 19, 19, 19))], 1.0
    )
    assert plan.preempt == ("beams",)


def test_a_waiting_sequence_resumes_into_its_request_when_it_fits() -> None:
    child = gw("par#3", 0.0, lane=1, prompts=(25,), parent="par")
    running = [gr("par", 0.0, lane=1, contexts=(30, 30, 30), seqs=(0, 1, 2))]
    pol = GenerationPolicy(tokens_policy(kv=110))
    assert pol.plan([child], running, 2.0).admit == ()  # 93 + 26 blocks > 110
    running = [gr("par", 0.0, lane=1, contexts=(30, 30), seqs=(0, 1))]  # one of them ended
    assert pol.plan([child], running, 3.0).admit == ("par#3",)


def test_a_waiting_sequence_is_not_resumed_into_a_request_freed_or_stopped() -> None:
    # Lane 0 frees a sequence of "par" while its other freed sequence waits: that one
    # does not go back in by the same plan, whatever room is left.
    child = gw("par#3", 0.0, lane=1, prompts=(1,), parent="par")
    running = [gr("par", 0.0, lane=1, contexts=(19, 19, 19), seqs=(0, 1, 2))]
    plan = GenerationPolicy(tokens_policy(kv=70)).plan(
        [gw("top", 1.0, prompts=(10,)), child], running, 1.0
    )
    assert plan.admit == ("top",)
    assert plan.preempt_seqs == (("par", (2,)),)
    # A request past its deadline stops: its waiting sequence ends with it (its text
    # kept by the worker), neither admitted nor expired on its own.
    late = gr("par", 0.0, lane=1, contexts=(5,), seqs=(0,), deadline=1.0)
    plan = GenerationPolicy(tokens_policy(kv=70)).plan(
        [gw("par#3", 0.0, lane=1, prompts=(1,), parent="par", deadline=1.0)], [late], 2.0
    )
    assert (plan.stop, plan.expire, plan.admit) == (("par",), (), ())


def _parallel(key: str, lane: int, arrived: float, prompt: int, n: int, length: int) -> GenRequest:
    return GenRequest(key, lane, arrived, (prompt,) * n, length, (length,) * n)


def test_simulated_squeeze_preempts_one_sequence_and_every_request_ends_once() -> None:
    # Given a lane-2 request of n = 4 decoding in a cache it nearly fills, when a lane-0
    # request comes: one sequence is freed (counted once, as vLLM counts a child), the
    # others keep generating; the freed one resumes by recomputation once lane 0 is done,
    # and every request ends exactly once within the budgets.
    policy = tokens_policy(kv=400, page=4, step=256, max_running=8)
    trace = [_parallel("par", 2, 0.0, 40, 4, 50), _parallel("top", 0, 0.1, 80, 1, 20)]
    report = simulate_generation(trace, policy)
    assert report.violations == ()
    assert report.finished == 2
    assert report.preemptions == 1
    assert report.max_step_blocks <= policy.total_blocks


def test_simulated_request_whose_sequences_are_all_freed_resumes_them_and_ends_once() -> None:
    # Given a lane-2 request of n = 3 decoding, then a lane-0 prompt that needs all its
    # blocks: its three sequences are each freed (three preemptions, as vLLM counts three
    # children; growth may free one again later) and resume into it; both end once.
    policy = tokens_policy(kv=200, page=4, step=256, max_running=8)
    trace = [_parallel("par", 2, 0.0, 40, 3, 30), _parallel("top", 0, 0.1, 180, 1, 20)]
    report = simulate_generation(trace, policy)
    assert report.violations == ()
    assert report.finished == 2 and report.lane(2).output_tokens == 3 * 30
    assert report.preemptions >= 3


def test_a_request_whose_sequences_outgrow_the_cache_together_frees_some_of_them() -> None:
    # Given three sequences of 16 tokens each (page 16): each next token needs a second
    # block, 6 blocks of 3; one sequence alone fits. Then the last two are freed (as vLLM
    # preempts child requests), not the request stopped as one that can never fit.
    plan = GenerationPolicy(tokens_policy(kv=48, page=16)).plan(
        [], [gr("par", 0.0, contexts=(16, 16, 16), seqs=(0, 1, 2))], 1.0
    )
    assert (plan.stop, plan.preempt, plan.preempt_seqs) == ((), (), (("par", (1, 2)),))
    # A sequence that alone outgrew the cache: its request ends ("length")
    plan = GenerationPolicy(tokens_policy(kv=48, page=16)).plan(
        [], [gr("par", 0.0, contexts=(48, 2), seqs=(0, 1))], 1.0
    )
    assert (plan.stop, plan.preempt_seqs) == (("par",), ())


# vLLM's priority scheduling preempts max(running, key=(priority, arrival_time)): the
# lowest lane, then the latest *arrival*, whenever it was admitted (a request redelivered
# from a lost worker keeps its place by arrival). Page 1, 101 blocks.
ORDER_CASES = [
    # (running: key, lane, arrived, started), expected growth victim
    ([("a", 1, 0.0, 0.0), ("b", 1, 1.0, 1.0)], "b"),  # same lane: the later arrival
    ([("late", 1, 0.0, 5.0), ("b", 1, 1.0, 2.0)], "b"),  # arrived first, started last
    ([("a", 2, 0.0, 0.0), ("b", 1, 1.0, 1.0)], "a"),  # a lower lane before any arrival
    ([("a", 1, 1.0, 0.0), ("b", 1, 1.0, 3.0)], "b"),  # same arrival: the later start
]


@pytest.mark.parametrize(("running", "victim"), ORDER_CASES)
def test_growth_victim_is_the_lowest_lane_latest_arrival(
    running: list[tuple[str, int, float, float]], victim: str
) -> None:
    # Each request decodes one sequence of 50 tokens, reserving 51 blocks (its next
    # token's too): 102 > 101, one of them goes.
    views = [
        gr(k, started, lane=lane, arrived=arrived, contexts=(50,))
        for k, lane, arrived, started in running
    ]
    plan = GenerationPolicy(tokens_policy(kv=101)).plan([], views, 9.0)
    assert plan.preempt == (victim,)
