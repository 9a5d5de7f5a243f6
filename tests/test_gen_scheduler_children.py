"""The generating scheduler (``worker/gen_scheduler.py``) with sequences preempted alone:
a squeeze frees a child of an ``n > 1`` request, which waits under its own key while its
siblings run on, resumes into its request when there is room (again if the step resuming
it is withdrawn), counts among the waiting sequences, and ends with its request once; a
failed hand-off fails such a request as one still running."""

from __future__ import annotations

from batchfleet.batching.gen_types import GenPolicy
from batchfleet.batching.generation import GenerationPolicy
from batchfleet.batching.types import Waiting
from batchfleet.schemas.messages import Request
from batchfleet.worker.answers import Held
from batchfleet.worker.executor import unfinished_failed
from batchfleet.worker.gen_scheduler import GenScheduler
from batchfleet.worker.runner import Failed, Final, Preempted, Prepared, Progress, StepReport, Work
from batchfleet.worker.streams import Entry


def held(key: str, lane: int, arrived: float, prompt: int, n: int = 1, new: int = 64) -> Held:
    prep = Prepared(None, rows=n, tokens=prompt * n, prompts=(prompt,) * n, max_new_tokens=new)
    req = Request(id=key, model="m", inputs=["x"], n=n, max_new_tokens=new)
    return Held(Entry(lane, key, {}), req, "msgpack", prep,
                Waiting(key, lane, arrived, prompt * n, n), arrived)  # fmt: skip


def scheduler(ahead: bool = False) -> GenScheduler:
    # 16 blocks of 16 tokens, no watermark: a sequence of 47 tokens reserves 3 blocks
    policy = GenPolicy(kv_cache_tokens=256, page_size=16, step_tokens=128, max_running=8,
                       watermark=0.0)  # fmt: skip
    return GenScheduler(GenerationPolicy(policy), ahead=ahead)


def squeezed(s: GenScheduler) -> None:
    """A lane-2 request of n = 4 decoding at 47 tokens each (12 of 16 blocks), then a
    lane-0 prompt of 70 tokens (5 blocks, 1 short): one child is freed for it."""
    s.admit(held("par", 2, 0.0, 40, n=4))
    first = s.decide(1.0).step
    assert first is not None
    s.finished(first.step_id, StepReport(progress={"par": Progress((47,) * 4, (0,) * 4, 50,
                                                                   (0, 1, 2, 3))}), 1.0, 1.1)  # fmt: skip
    s.admit(held("top", 0, 1.2, 70))
    step = s.decide(1.2).step
    assert step is not None
    assert [h.waiting.key for h in step.held] == ["top"]
    assert step.preempt == () and step.preempt_seqs == (("par", (3,)),)
    freed = Preempted("par", (47,), 57, (3,), alone=True, freed=1)
    rest = Progress((47,) * 3, (0,) * 3, 49, (0, 1, 2))
    s.finished(step.step_id, StepReport(events=[freed], progress={"par": rest,
               "top": Progress((70,), (0,), 64, (0,))}), 1.2, 1.3)  # fmt: skip


def test_a_child_freed_alone_waits_and_resumes_into_its_running_request() -> None:
    s = scheduler()
    squeezed(s)
    assert set(s.running) == {"par", "top"} and s.running["par"].preempted == 1
    assert list(s.children.waiting) == ["par#3"] and s.waiting_sequences() == 1
    # The lane-0 request ends: the child fits again and resumes into "par".
    step = s.decide(1.3).step
    assert step is not None  # (the running ones step on; no room yet)
    assert step.resume == () and step.preempt_seqs == ()
    s.finished(step.step_id, StepReport(events=[Final("top", [])], progress={
        "par": Progress((49,) * 3, (0,) * 3, 48, (0, 1, 2))}), 1.3, 1.4)  # fmt: skip
    step = s.decide(1.4).step
    assert step is not None and step.held == [] and step.resume == (("par", (3,), 2),)
    assert s.children.waiting == {} and s.running["par"].progress.seqs == (0, 1, 2, 3)
    # Its request ends once, the child with it; nothing of it is left waiting.
    s.finished(step.step_id, StepReport(events=[Final("par", [])]), 1.4, 1.5)
    assert s.running == {} and s.children.waiting == {} and s.decide(1.5).step is None


def test_a_withdrawn_resumption_leaves_the_child_waiting_again() -> None:
    s = scheduler(ahead=True)
    squeezed(s)
    running = s.decide(1.3).step  # on the device
    assert running is not None
    s.finished(running.step_id, StepReport(events=[Final("top", [])], progress={
        "par": Progress((49,) * 3, (0,) * 3, 48, (0, 1, 2))}), 1.3, 1.4)  # fmt: skip
    on_device = s.decide(1.4).step
    assert on_device is not None and on_device.resume == (("par", (3,), 2),)
    # (a step queued behind it resumes nothing more: the child is in flight)
    queued = s.decide(1.4).step
    assert queued is not None and queued.resume == ()
    s.withdraw(queued.step_id)
    assert s.children.waiting == {}
    # The step on the device taken back (stopping): the child waits again, not in "par".
    s.cancel([on_device.step_id])
    assert list(s.children.waiting) == ["par#3"]
    assert s.running["par"].progress.seqs == (0, 1, 2)


def test_a_request_cancelled_with_a_child_waiting_ends_once_and_the_child_never_resumes() -> None:
    s = scheduler()
    squeezed(s)
    assert s.stop("par", "cancelled") is None
    step = s.decide(1.3).step
    assert step is not None and step.stop == (("par", "cancelled"),) and step.resume == ()
    s.finished(step.step_id, StepReport(events=[Final("par", [])]), 1.3, 1.4)
    assert "par" not in s.running and s.children.waiting == {}


def test_a_failed_hand_off_fails_a_request_with_a_child_freed_alone_it_runs_on() -> None:
    # (a request preempted whole left the runner: nothing of it is left to fail)
    report = StepReport(events=[Preempted("a", (5,), 3, (1,), alone=True, freed=1),
                                Preempted("b", (5, 5), 3, (0, 1))])  # fmt: skip
    out = unfinished_failed(Work("s", ()), report, RuntimeError("sink down"))
    assert [ev.key for ev in out.events if isinstance(ev, Failed)] == ["a"]
    assert out.abandoned == ("a",)


def test_a_request_preempted_whole_that_no_longer_fits_together_ends_with_length() -> None:
    # Given a request of n = 2 preempted whole once its sequences had grown to 200 tokens
    # each: 13 blocks each, 26 together of 16; no deadline
    s = scheduler()
    s.admit(held("big", 1, 0.0, 40, n=2))
    first = s.decide(1.0).step
    assert first is not None
    s.finished(first.step_id, StepReport(events=[Preempted("big", (200, 200), 30, (0, 1))]),
               1.0, 1.1)  # fmt: skip
    # When it is planned again, it can never start: it ends, with what it made, by
    # "length" (it outgrew the cache), not "deadline"
    decision = s.decide(1.2)
    assert decision.refused == []  # (it made text: not refused)
    step = decision.step
    assert step is not None and step.stop == (("big", "length"),)


def test_a_new_request_whose_sequences_never_fit_together_is_refused_with_why() -> None:
    # Given a request of n = 5 whose prompts of 60 tokens need 4 blocks each: 20 blocks
    # together of the cache's 16 (each alone fits), and one of n = 2 behind it
    s = scheduler()
    s.admit(held("wide", 0, 0.0, 60, n=5))
    s.admit(held("ok", 0, 0.1, 60, n=2))
    # When planned: it is refused (invalid_request), not expired; the other runs
    decision = s.decide(1.0)
    assert decision.expired == []
    ((h, why),) = decision.refused
    assert h.waiting.key == "wide" and "wide" not in s.held and "wide" not in s.running
    assert why.startswith("this request can never start") and "5 sequences together" in why
    assert decision.step is not None and [x.waiting.key for x in decision.step.held] == ["ok"]


def test_every_sequence_freed_alone_the_request_runs_on_and_they_resume_into_it() -> None:
    # Given a lane-2 request of n = 2 decoding at 47 tokens each (6 of 16 blocks), when a
    # lane-0 prompt of 250 tokens (16 blocks) comes: both sequences are freed alone (as
    # vLLM preempts both children), not the request whole
    s = scheduler()
    s.admit(held("par", 2, 0.0, 40, n=2))
    first = s.decide(1.0).step
    assert first is not None
    s.finished(first.step_id, StepReport(progress={"par": Progress((47,) * 2, (0,) * 2, 50,
                                                                   (0, 1))}), 1.0, 1.1)  # fmt: skip
    s.admit(held("top", 0, 1.2, 250))
    step = s.decide(1.2).step
    assert step is not None and [h.waiting.key for h in step.held] == ["top"]
    assert step.preempt == () and step.preempt_seqs == (("par", (0, 1)),)
    freed = [Preempted("par", (47,), 57, (i,), alone=True, freed=1) for i in (0, 1)]
    s.finished(step.step_id, StepReport(events=freed, progress={
        "par": Progress((), (), 57, ()), "top": Progress((250,), (0,), 64, (0,))}), 1.2, 1.3)  # fmt: skip
    # Then it runs on with none, its two sequences waiting (not the request itself)
    assert "par" in s.running and "par" not in s.held
    assert sorted(s.children.waiting) == ["par#0", "par#1"] and s.waiting_sequences() == 2
    # When lane 0 ends, they resume into it
    step = s.decide(1.3).step
    assert step is not None
    s.finished(step.step_id, StepReport(events=[Final("top", [])]), 1.3, 1.4)
    step = s.decide(1.4).step
    assert step is not None and step.resume == (("par", (0, 1), 2),) and step.held == []


def test_a_request_of_one_sequence_is_preempted_whole_even_before_its_first_report() -> None:
    # Given a lane-2 request of one 200-token prompt just admitted (13 of 16 blocks; its
    # runner has not reported yet), when a lane-0 prompt of 60 tokens (4 blocks) comes:
    # it is preempted whole (it waits and resumes as a request), not as a sequence alone
    s = scheduler()
    s.admit(held("low", 2, 0.0, 200))
    assert s.decide(1.0).step is not None
    s.admit(held("top", 0, 1.1, 60))
    s.ahead = True  # (planned while the first step runs: from the admission's view)
    step = s.decide(1.1).step
    assert step is not None and [h.waiting.key for h in step.held] == ["top"]
    assert step.preempt == ("low",) and step.preempt_seqs == ()
