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

from batchfleet.schemas.messages import Request  # noqa: E402
from batchfleet.worker.runner import Final, Partial, Preempted, Prepared, Work  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

PROMPT = "the man was"


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture(params=["padded", "paged"])
def runner(lm_dir: Path, request: pytest.FixtureRequest) -> TextGenerationRunner:
    opts = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 16,
            "engine": request.param}  # fmt: skip
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
