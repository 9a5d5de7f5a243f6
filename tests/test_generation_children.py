"""One sequence of a request of ``n > 1`` preempted alone (as vLLM preempts a child
request): its siblings keep generating, it resumes by recomputation after its last token
with its own generator, and the request ends once with the texts, usage and stream it
would have had without the preemption (tiny Llama, both engines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.batching.generation import GenerationPolicy  # noqa: E402
from batchfleet.batching.types import Waiting  # noqa: E402
from batchfleet.schemas.messages import Request  # noqa: E402
from batchfleet.worker.answers import Held  # noqa: E402
from batchfleet.worker.gen_scheduler import GenScheduler  # noqa: E402
from batchfleet.worker.runner import Final, Partial, Preempted, Prepared, Work  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from batchfleet.worker.streams import Entry  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

PROMPT = "the man was"


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture(params=["padded", "paged"])
def runner(lm_dir: Path, request: pytest.FixtureRequest) -> TextGenerationRunner:
    """``tight``: the padded engine with a cache of 10 blocks of 16 tokens."""
    opts: dict[str, Any] = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64,
                            "max_running": 16, "engine": request.param}  # fmt: skip
    if request.param == "tight":
        opts.update(engine="padded", kv_cache_tokens=160, prefix_cache_tokens=0)
    return TextGenerationRunner(lm_dir, device=DEVICE, dtype="float32", options=opts)


class Run:
    """A request of ``n`` completions stepped to its end; sequence 1 preempted alone at
    step ``park`` and resumed at step ``back`` (None: never)."""

    def __init__(self, runner: TextGenerationRunner, park: int | None, back: int, **kw: Any):
        (prep,) = runner.prepare_many([Request(id="par", model="lm", inputs=[PROMPT],
                                               max_new_tokens=12, stream=True, **kw)])  # fmt: skip
        assert isinstance(prep, Prepared)
        self.final: Final | None = None
        self.partials: list[dict[str, Any]] = []
        self.preempted: list[Preempted] = []
        self.made_while_parked: dict[int, int] = {}
        for i in range(60):
            work = Work(f"s{i}", (("par", prep),) if i == 0 else ())
            if i == park:
                work = Work(f"s{i}", (), preempt_seqs=(("par", (1,)),))
            elif i == back:
                work = Work(f"s{i}", (), resume=(("par", (1,), 0),))
            report = runner.step(work)
            report.settle()
            for ev in report.events:
                if isinstance(ev, Final):
                    assert self.final is None, "a request ended twice"
                    self.final = ev
                elif isinstance(ev, Partial):
                    self.partials.append(ev.chunk)
                    if park is not None and park <= i < back:
                        k = ev.chunk["input"]
                        self.made_while_parked[k] = self.made_while_parked.get(k, 0) + 1
                elif isinstance(ev, Preempted):
                    self.preempted.append(ev)
            if park is not None and park <= i < back and "par" in report.progress:
                assert 1 not in report.progress["par"].seqs  # out of the engine meanwhile
            if self.final is not None:
                return
        raise AssertionError("did not finish")

    def texts(self) -> list[str]:
        assert self.final is not None
        return [o["text"] for o in self.final.outputs]


@pytest.mark.parametrize(
    "sampling",
    # (a low temperature: the tiny random model's draws then depend on the context; its
    # greedy text repeats one token)
    [{"n": 3, "temperature": 0.3, "seed": 7}, {"n": 2}],
    ids=["seeded-sampled", "greedy"],
)
def test_a_sequence_preempted_alone_resumes_to_the_same_text_while_its_siblings_run(
    runner: TextGenerationRunner, sampling: dict[str, Any]
) -> None:
    plain = Run(runner, None, -1, **sampling)
    squeezed = Run(runner, 3, 6, **sampling)
    assert squeezed.texts() == plain.texts()
    # Freed alone, counted once; its siblings made tokens while it waited, it made none.
    (ev,) = squeezed.preempted
    assert (ev.seqs, ev.alone, ev.sequences) == ((1,), True, 1)
    assert ev.prompts[0] == len(runner.tokenizer(PROMPT).input_ids) + 12 - ev.max_new_tokens
    assert squeezed.made_while_parked.get(0, 0) >= 2 and 1 not in squeezed.made_while_parked
    # Each output's usage counts its tokens once (not the recomputed ones again) and its
    # stream adds up to it: nothing resent after the resume.
    assert squeezed.final is not None
    for k, out in enumerate(squeezed.final.outputs):
        assert out["completion_tokens"] == 12
        assert out["finish_reason"] == "length"
        mine = [c for c in squeezed.partials if c["input"] == k]
        assert "".join(c["text"] for c in mine) == out["text"]
        assert sum(c["tokens"] for c in mine) == 12


def test_a_request_stopped_with_a_sequence_parked_ends_once_with_every_text(
    runner: TextGenerationRunner,
) -> None:
    (prep,) = runner.prepare_many([Request(id="st", model="lm", inputs=["a b c"], n=2,
                                           max_new_tokens=20)])  # fmt: skip
    runner.step(Work("a", (("st", prep),)))
    runner.step(Work("b", ()))
    runner.step(Work("c", (), preempt_seqs=(("st", (0,)),)))
    runner.step(Work("d", ()))
    report = runner.step(Work("e", (), stop=(("st", "cancelled"),)))
    (final,) = [ev for ev in report.events if isinstance(ev, Final)]
    first, second = final.outputs
    assert first["finish_reason"] == second["finish_reason"] == "cancelled"
    assert 0 < first["completion_tokens"] < second["completion_tokens"] < 20
    assert not runner._reqs and not runner._by_seq


def _held(runner: TextGenerationRunner, key: str, lane: int, at: float, **kw: Any) -> Held:
    req = Request(id=key, model="lm", **kw)
    (prep,) = runner.prepare_many([req])
    assert isinstance(prep, Prepared)
    return Held(Entry(lane, key, {}), req, "msgpack", prep,
                Waiting(key, lane, at, prep.tokens, prep.rows), at)  # fmt: skip


def _serve(runner: TextGenerationRunner, top_at: int | None) -> tuple[Final, list[Preempted]]:
    """The scheduler and the runner in virtual time: a lane-2 request of n = 4 decoding,
    and (at step ``top_at``) a lane-0 request of 40 prompt tokens that does not fit."""
    s = GenScheduler(GenerationPolicy(runner.generation_policy(3, (4.0, 2.0, 1.0), 2000.0)))
    s.admit(_held(runner, "par", 2, 0.0, inputs=[PROMPT], n=4, max_new_tokens=24,
                  temperature=0.3, seed=5))  # fmt: skip
    finals: dict[str, Final] = {}
    preempted: list[Preempted] = []
    now = 0.0
    for i in range(200):
        if i == top_at:
            s.admit(_held(runner, "top", 0, now, inputs=[" ".join(["a b"] * 20)],
                          max_new_tokens=4))  # fmt: skip
        step = s.decide(now).step
        if step is None:
            break
        report = runner.step(step.work())
        report.settle()
        s.finished(step.step_id, report, now, now + 0.01)
        now += 0.01
        finals |= {ev.key: ev for ev in report.events if isinstance(ev, Final)}
        preempted += [ev for ev in report.events if isinstance(ev, Preempted)]
    assert set(finals) == ({"par", "top"} if top_at is not None else {"par"})
    assert not s.running and not s.held and not s.children.waiting
    return finals["par"], preempted


@pytest.mark.parametrize("runner", ["tight"], indirect=True)
def test_a_squeeze_through_the_scheduler_frees_one_child_and_its_text_is_kept(
    runner: TextGenerationRunner,
) -> None:
    # 10 blocks of 16 tokens: "par"'s four sequences take 8, the lane-0 prompt needs 3.
    alone, none = _serve(runner, None)
    squeezed, freed = _serve(runner, 14)
    assert none == [] and freed and all(ev.alone for ev in freed)
    assert sum(ev.sequences for ev in freed) < 4  # never all four at once
    assert [o["text"] for o in squeezed.outputs] == [o["text"] for o in alone.outputs]
    assert [o["completion_tokens"] for o in squeezed.outputs] == [24] * 4
