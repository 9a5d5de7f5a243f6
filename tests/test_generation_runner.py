"""The text-generation runner, stepped directly (no Redis, no loop): continuous batching
gives exactly the tokens of one-at-a-time ``generate``; sampling is per request and
seeded; stop strings, cancellation, preemption and streaming behave as documented."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.errors import ErrorCode  # noqa: E402
from batchfleet.schemas.messages import Request  # noqa: E402
from batchfleet.worker.runner import (  # noqa: E402
    LOST,
    Failed,
    Final,
    Partial,
    Preempted,
    Prepared,
    PrepareError,
    Progress,
    StepReport,
    Work,
)
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

PROMPTS = ["the man was", "a b c", "there were many years of time and", "it", "what is this"]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture(params=["padded", "paged", "speculative"])
def runner(lm_dir: Path, request: pytest.FixtureRequest) -> TextGenerationRunner:
    """speculative: the padded engine with n-gram speculative decoding (a tiny random
    model's greedy text repeats itself: most steps emit several tokens a row)."""
    opts: dict[str, Any] = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64,
                            "max_running": 16, "engine": request.param}  # fmt: skip
    if request.param == "speculative":
        opts.update(engine="padded", speculative={"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 1,
                                                  "prompt_lookup_max": 3})  # fmt: skip
    return TextGenerationRunner(lm_dir, device=DEVICE, dtype="float32", options=opts)


def req(rid: str, **kw: Any) -> Request:
    kw.setdefault("inputs", ["the man was"])
    return Request(id=rid, model="lm", **kw)


def prepare(runner: TextGenerationRunner, *reqs: Request) -> list[Prepared]:
    out = runner.prepare_many(list(reqs))
    assert all(isinstance(p, Prepared) for p in out), out
    return out  # type: ignore[return-value]


class Driver:
    """Steps a runner; collects Finals and Partials by key."""

    def __init__(self, runner: TextGenerationRunner) -> None:
        self.runner = runner
        self.finals: dict[str, Final] = {}
        self.partials: dict[str, list[dict[str, Any]]] = {}
        self.preempted: dict[str, Preempted] = {}
        self.failed: dict[str, Failed] = {}
        self.reports: list[StepReport] = []
        self.n = 0

    def step(
        self,
        admit: Iterable[tuple[str, Prepared]] = (),
        stop: Iterable[tuple[str, str]] = (),
        preempt: Iterable[str] = (),
    ) -> None:
        self.n += 1
        report = self.runner.step(Work(f"s{self.n}", tuple(admit), tuple(stop), tuple(preempt)))
        self.reports.append(report)
        for ev in report.events:
            if isinstance(ev, Final):
                assert ev.key not in self.finals, "a request ended twice"
                self.finals[ev.key] = ev
            elif isinstance(ev, Partial):
                self.partials.setdefault(ev.key, []).append(ev.chunk)
            elif isinstance(ev, Preempted):
                self.preempted[ev.key] = ev
            elif isinstance(ev, Failed):
                assert ev.key not in self.failed and ev.key not in self.finals
                self.failed[ev.key] = ev
            else:
                raise AssertionError(ev)

    def run(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.runner._reqs or all(r.parked for r in self.runner._reqs.values()):
                return
            self.step()
        raise AssertionError("did not finish")


def run(runner: TextGenerationRunner, *reqs: Request) -> dict[str, list[dict[str, Any]]]:
    """Each request's outputs, all admitted in one step and run to their ends."""
    d = Driver(runner)
    d.step([(r.id, p) for r, p in zip(reqs, prepare(runner, *reqs), strict=True)])
    d.run()
    return {k: f.outputs for k, f in d.finals.items()}


def greedy_ids(runner: TextGenerationRunner, text: str, n: int) -> list[int]:
    ids = runner.tokenizer(text, return_tensors="pt").input_ids.to(runner.torch_device)
    out = runner.model.generate(ids, max_new_tokens=n, do_sample=False,
                                pad_token_id=runner.eos[0])  # fmt: skip
    return [int(t) for t in out[0, ids.shape[1] :]]


def greedy(runner: TextGenerationRunner, text: str, n: int) -> str:
    return str(runner.tokenizer.decode(greedy_ids(runner, text, n), skip_special_tokens=True))


def test_continuous_batching_gives_the_tokens_of_one_at_a_time_generate(
    runner: TextGenerationRunner,
) -> None:
    preps = prepare(runner, *(req(f"r{i}", inputs=[p], max_new_tokens=6 + 3 * i)
                              for i, p in enumerate(PROMPTS)))  # fmt: skip
    d = Driver(runner)
    d.step([("r0", preps[0]), ("r1", preps[1])])
    d.step([("r2", preps[2])])  # joins while the first two decode
    d.step()
    d.step([("r3", preps[3]), ("r4", preps[4])])
    d.run()
    for i, p in enumerate(PROMPTS):
        out = d.finals[f"r{i}"].outputs[0]
        assert out["text"] == greedy(runner, p, 6 + 3 * i)
        assert out["completion_tokens"] == 6 + 3 * i
        assert out["finish_reason"] == "length"
        assert out["prompt_tokens"] == len(runner.tokenizer(p).input_ids)
    assert not runner._reqs and not runner._by_seq


def test_the_padded_engine_holds_the_kv_budget_and_shows_what_it_holds(
    runner: TextGenerationRunner,
) -> None:
    (p,) = prepare(runner, req("r", max_new_tokens=4))
    d = Driver(runner)
    d.step([("r", p)])
    d.run()
    info = runner.info()
    if runner.engine_kind == "paged" or runner.torch_device.type != "cpu":
        # paged: sized from the budget at start; a GPU's buffers grow, nothing to release
        assert "kv_resident_tokens" not in info
        return
    assert runner.engine.resident_tokens == 2048  # type: ignore[attr-defined]
    prompt = len(runner.tokenizer("the man was").input_ids)
    assert info["kv_resident_tokens"] == prompt + 3 and info["kv_released_bytes"] == 0


def test_a_request_with_several_inputs_answers_each(runner: TextGenerationRunner) -> None:
    (p,) = prepare(runner, req("r", inputs=PROMPTS[:3], max_new_tokens=5))
    d = Driver(runner)
    d.step([("r", p)])
    d.run()
    texts = [o["text"] for o in d.finals["r"].outputs]
    assert texts == [greedy(runner, t, 5) for t in PROMPTS[:3]]


def test_chat_messages_use_the_chat_template(runner: TextGenerationRunner) -> None:
    msgs = [{"role": "user", "content": "what is this"}]
    (p,) = prepare(runner, req("c", inputs=[], messages=msgs, max_new_tokens=4))
    rendered = runner.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                    tokenize=False)  # fmt: skip
    assert rendered.endswith("<|im_start|>assistant\n")
    assert list(p.payload.prompts[0]) == runner.tokenizer(rendered).input_ids


def test_streamed_deltas_add_up_to_the_final_text(runner: TextGenerationRunner) -> None:
    (p,) = prepare(runner, req("s", inputs=PROMPTS[:2], max_new_tokens=9, stream=True))
    d = Driver(runner)
    d.step([("s", p)])
    d.run()
    for i, out in enumerate(d.finals["s"].outputs):
        chunks = [c for c in d.partials["s"] if c["input"] == i]
        assert "".join(c["text"] for c in chunks) == out["text"]
        assert sum(c["tokens"] for c in chunks) == out["completion_tokens"]


def test_no_deltas_without_stream(runner: TextGenerationRunner) -> None:
    (p,) = prepare(runner, req("q", max_new_tokens=4))
    d = Driver(runner)
    d.step([("q", p)])
    d.run()
    assert "q" not in d.partials and "q" in d.finals


def test_each_step_reports_its_tokens_and_streams_a_delta_for_them(
    runner: TextGenerationRunner,
) -> None:
    long = " ".join(["there were many years"] * 30)  # prefills over several steps
    prep = dict(zip("qsl", prepare(runner, req("q", max_new_tokens=6),
                                   req("s", inputs=PROMPTS[:2], max_new_tokens=6, stream=True),
                                   req("l", inputs=[long], max_new_tokens=3, stream=True)),
                    strict=True))  # fmt: skip
    (cut,) = prepare(runner, req("cut", inputs=[long], max_new_tokens=3, stream=True))
    produced: dict[str, list[int]] = {}
    streamed: dict[str, list[int]] = {}
    finals: dict[str, Final] = {}
    admit = [*prep.items(), ("cut", cut)]
    for n in range(60):
        work = Work(f"s{n}", tuple(admit), (("cut", "cancelled"),) if n == 1 else ())
        admit = []
        report = runner.step(work)
        assert report.produced is not None
        for key, k in report.produced.items():
            produced.setdefault(key, [0] * 60)[n] += k
        for ev in report.events:
            if isinstance(ev, Partial):
                streamed.setdefault(ev.key, [0] * 60)[n] += ev.chunk["tokens"]
            elif isinstance(ev, Final):
                finals[ev.key] = ev
        if len(finals) == 4:
            break
    for key in "qsl":
        assert sum(produced[key]) == sum(o["completion_tokens"] for o in finals[key].outputs)
    # a streamed request's tokens go out in the step that made them, text or not
    assert streamed["s"] == produced["s"] and streamed["l"] == produced["l"]
    assert "q" not in streamed
    # stopped while prefilling: no token
    assert finals["cut"].outputs[0]["completion_tokens"] == 0
    assert "cut" not in produced and "cut" not in streamed


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates(
    runner: TextGenerationRunner,
) -> None:
    def sample(seed: int, mates: int) -> str:
        preps = prepare(runner, req("x", max_new_tokens=12, temperature=1.5, seed=seed),
                        *(req(f"m{i}", inputs=[PROMPTS[i]], max_new_tokens=7, temperature=1.0)
                          for i in range(mates)))  # fmt: skip
        d = Driver(runner)
        d.step([(f"m{i}", preps[1 + i]) for i in range(mates)])
        d.step([("x", preps[0])])
        d.run()
        return str(d.finals["x"].outputs[0]["text"])

    a = sample(7, 0)
    assert sample(7, 3) == a
    assert sample(7, 1) == a
    assert sample(8, 0) != a or sample(9, 0) != a
    assert a != greedy(runner, "the man was", 12)


def test_top_k_one_is_greedy(runner: TextGenerationRunner) -> None:
    (p,) = prepare(runner, req("k", max_new_tokens=8, temperature=2.0, top_k=1, seed=3))
    d = Driver(runner)
    d.step([("k", p)])
    d.run()
    assert d.finals["k"].outputs[0]["text"] == greedy(runner, "the man was", 8)


def test_a_stop_string_ends_the_text_before_it(runner: TextGenerationRunner) -> None:
    full = greedy(runner, "a b c", 12)
    stop = full[5:7]
    assert stop.strip(), full
    (p,) = prepare(runner, req("st", inputs=["a b c"], max_new_tokens=12, stop=["§§", stop],
                               stream=True))  # fmt: skip
    d = Driver(runner)
    d.step([("st", p)])
    d.run()
    out = d.finals["st"].outputs[0]
    assert out["finish_reason"] == "stop"
    assert out["stop_reason"] == stop  # vLLM's: the stop string that ended it
    assert out["text"] == full[: full.index(stop)]
    assert "".join(c["text"] for c in d.partials.get("st", [])) == out["text"]


def test_include_stop_str_in_output_keeps_the_stop_string(runner: TextGenerationRunner) -> None:
    full = greedy(runner, "a b c", 12)
    stop = full[5:7]
    (p, cut) = prepare(runner, req("in", inputs=["a b c"], max_new_tokens=12, stop=[stop],
                                   stream=True, include_stop_str_in_output=True),
                       req("cut", inputs=["a b c"], max_new_tokens=12, stop=[stop]))  # fmt: skip
    d = Driver(runner)
    d.step([("in", p), ("cut", cut)])
    d.run()
    out = d.finals["in"].outputs[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == full[: full.index(stop) + len(stop)]  # cut after it
    assert "".join(c["text"] for c in d.partials["in"]) == out["text"]
    assert d.finals["cut"].outputs[0]["text"] == full[: full.index(stop)]


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(
    runner: TextGenerationRunner,
) -> None:
    long = "there were many years of time and " * 200  # over the context
    ids = runner.tokenizer(long).input_ids
    assert len(ids) > runner.max_prompt_tokens
    (refused,) = runner.prepare_many([req("x", inputs=[long])])
    assert isinstance(refused, PrepareError) and refused.code == ErrorCode.TOO_LARGE
    (p,) = prepare(runner, req("t", inputs=[long], max_new_tokens=6, truncate_prompt_tokens=10))
    d = Driver(runner)
    d.step([("t", p)])
    d.run()
    out = d.finals["t"].outputs[0]
    assert out["prompt_tokens"] == 10
    tail = torch.tensor([ids[-10:]], device=runner.torch_device)
    want = runner.model.generate(tail, max_new_tokens=6, do_sample=False,
                                 pad_token_id=runner.eos[0])[0, 10:]  # fmt: skip
    assert out["text"] == runner.tokenizer.decode(want, skip_special_tokens=True)


def test_stop_ends_a_running_request_with_its_text_so_far(runner: TextGenerationRunner) -> None:
    (p,) = prepare(runner, req("c", max_new_tokens=40))
    d = Driver(runner)
    d.step([("c", p)])
    for _ in range(4):
        d.step()
    d.step(stop=[("c", "cancelled")])
    out = d.finals["c"].outputs[0]
    assert out["finish_reason"] == "cancelled"
    assert 0 < out["completion_tokens"] < 40
    assert greedy(runner, "the man was", 40).startswith(out["text"])
    assert not runner._reqs and not runner._by_seq


def _first_step_decodes(runner: TextGenerationRunner) -> int:
    """Tokens a sequence gets in its first step beyond the prefill's: the padded engine
    with transformers' forwards decodes a sequence in the step its prefill ends; its
    lean fused step (a Llama on CPU) and the paged engine from the next."""
    if runner.engine_kind != "padded":
        return 0
    return 0 if getattr(runner.engine, "lean", None) is not None else 1


def test_preempted_request_resumes_to_the_same_text(runner: TextGenerationRunner) -> None:
    (p,) = prepare(runner, req("pre", inputs=PROMPTS[:2], max_new_tokens=14, stream=True))
    d = Driver(runner)
    d.step([("pre", p)])
    spec = runner.speculative is not None  # a step may give several tokens: fewer steps
    for _ in range(1 if spec else 4):
        d.step()
    d.step(preempt=["pre"])
    ev = d.preempted["pre"]
    made = 5 + _first_step_decodes(runner)
    if spec:
        made = 14 - ev.max_new_tokens
        assert 2 <= made < 14
    assert ev.max_new_tokens == 14 - made
    assert ev.prompts[0] == len(runner.tokenizer(PROMPTS[0]).input_ids) + made
    assert runner.engine.state("pre#0") is None
    d.step()  # it holds no memory and makes no progress meanwhile
    d.step([("pre", p)])
    d.run()
    outs = d.finals["pre"].outputs
    assert [o["text"] for o in outs] == [greedy(runner, t, 14) for t in PROMPTS[:2]]
    assert [o["completion_tokens"] for o in outs] == [14, 14]
    assert "".join(c["text"] for c in d.partials["pre"] if c["input"] == 0) == outs[0]["text"]


def test_progress_reports_context_and_prefill(runner: TextGenerationRunner) -> None:
    long_prompt = " ".join(["the man was there"] * 40)
    (p,) = prepare(runner, req("long", inputs=[long_prompt], max_new_tokens=3))
    n = p.payload.prompts[0].__len__()
    assert n > 64  # longer than a step's budget: prefilled in chunks
    report = runner.step(Work("s1", (("long", p),)))
    assert report.progress == {}  # filled in after the step's deltas are streamed
    report.settle()
    prog = report.progress["long"]
    assert prog.prefill_left[0] == n - 64 and prog.contexts[0] == 64
    assert not report.events


def test_progress_counts_each_unfinished_sequence_and_the_most_new_tokens_left(
    runner: TextGenerationRunner,
) -> None:
    """A request of one input and one of two: per sequence its KV context and prompt left
    to prefill, and the most new tokens any of its sequences may still take (what the
    deltas streamed so far leave); a sequence that ended (a stop token) drops out."""
    texts = [" ".join(["a man went home"] * 40), "a b c"]
    made_by = [greedy_ids(runner, t, 6) for t in texts]
    stop = next(t for t in made_by[1][1:] if t not in made_by[0])  # ends input 1 only
    one, pair = prepare(
        runner,
        req("one", inputs=[" ".join(["the man was there"] * 40)], max_new_tokens=6, stream=True),
        req("pair", inputs=texts, max_new_tokens=6, stream=True, stop_token_ids=[stop]),
    )
    n = len(one.payload.prompts[0])
    d = Driver(runner)
    d.step([("one", one), ("pair", pair)])
    report = d.reports[-1]
    report.settle()
    assert report.progress["one"] == Progress((64,), (n - 64,), 6)  # the step's budget: 64
    assert report.progress["pair"] == Progress(
        (0, 0), tuple(len(p) for p in pair.payload.prompts), 6, (0, 1)
    )
    made = {("one", 0): 0, ("pair", 0): 0, ("pair", 1): 0}
    checked = 0
    ended: set[tuple[str, int]] = set()
    while len(d.finals) < 2:
        d.step()
        report = d.reports[-1]
        report.settle()
        for ev in report.events:
            if isinstance(ev, Partial):
                made[ev.key, ev.chunk["input"]] += ev.chunk["tokens"]
        if made["pair", 1] > made_by[1].index(stop):
            ended.add(("pair", 1))
        for key, prog in report.progress.items():
            inputs = [k for k in made if k[0] == key and k not in ended]
            assert len(prog.contexts) == len(prog.prefill_left) == len(inputs)
            assert prog.max_new_tokens_left == 6 - min(made[k] for k in inputs)
            checked += 1
    assert checked >= 6 and ended


def test_bad_requests_are_refused_in_prepare(runner: TextGenerationRunner) -> None:
    too_long = " ".join(["word"] * 3000)
    (out,) = runner.prepare_many([req("a", inputs=[too_long])])
    assert isinstance(out, PrepareError) and out.code == ErrorCode.TOO_LARGE
    # max_new_tokens past the limits never reaches a runner: the request is invalid
    with pytest.raises(ValueError, match="too_large: max_new_tokens 5000 > 4096"):
        req("b", max_new_tokens=5000)
    # within the limits but past the context: generation stops at the context ("length")
    (p,) = prepare(runner, req("c", max_new_tokens=4000))
    assert p.payload.max_new_tokens[0] == runner.context - len(p.payload.prompts[0])


def test_encoder_runners_refuse_generation_fields(tmp_path: Path) -> None:
    from batchfleet.worker.runners.embedding import EmbeddingRunner
    from tiny_models import make_embedding_model

    enc = EmbeddingRunner(make_embedding_model(tmp_path / "e"))
    out = enc.prepare_many([req("a"), req("b", max_new_tokens=3), req("c", inputs=[],
                            messages=[{"role": "user", "content": "x"}]),
                            req("d", repetition_penalty=1.2)])  # fmt: skip
    assert isinstance(out[0], Prepared)
    assert isinstance(out[1], PrepareError) and "max_new_tokens" in str(out[1])
    assert isinstance(out[2], PrepareError) and "messages" in str(out[2])
    assert isinstance(out[3], PrepareError) and "repetition_penalty" in str(out[3])


def test_a_sampled_request_preempted_and_resumed_draws_the_same_tokens(
    runner: TextGenerationRunner,
) -> None:
    def run(preempt_at: int | None) -> str:
        (p,) = prepare(runner, req("smp", max_new_tokens=10, temperature=1.3, seed=11))
        d = Driver(runner)
        d.step([("smp", p)])
        for i in range(3):
            d.step(preempt=["smp"] if i == preempt_at else ())
        if preempt_at is not None:
            d.step([("smp", p)])
        d.run()
        return str(d.finals["smp"].outputs[0]["text"])

    assert run(1) == run(None)


def test_a_preempted_request_stopped_while_parked_keeps_its_text(
    runner: TextGenerationRunner,
) -> None:
    (p,) = prepare(runner, req("pk", max_new_tokens=20))
    d = Driver(runner)
    d.step([("pk", p)])
    d.step()
    d.step(preempt=["pk"])
    d.step(stop=[("pk", "deadline")])
    out = d.finals["pk"].outputs[0]
    assert out["finish_reason"] == "deadline"
    if runner.speculative is not None:  # a step may give several tokens
        assert 2 <= out["completion_tokens"] < 20
    else:
        assert out["completion_tokens"] == 2 + _first_step_decodes(runner)
    assert greedy(runner, "the man was", 20).startswith(out["text"])
    assert not runner._reqs


def test_out_of_memory_preempts_and_shrinks_the_step_budget_then_resumes(
    runner: TextGenerationRunner,
) -> None:
    preps = prepare(runner, req("o1", max_new_tokens=8), req("o2", inputs=["a b c"],
                                                           max_new_tokens=8))  # fmt: skip
    d = Driver(runner)
    d.step([("o1", preps[0]), ("o2", preps[1])])
    d.step()
    real = runner.engine.step

    def oom() -> Any:
        runner.engine.step = real  # once
        raise MemoryError("out of memory (fake)")

    runner.engine.step = oom  # type: ignore[method-assign]
    before = runner.step_tokens
    report = runner.step(Work("boom", ()))
    assert report.out_of_memory and runner.step_tokens == before // 2
    assert sorted(e.key for e in report.events if isinstance(e, Preempted)) == ["o1", "o2"]
    assert runner.engine.step_tokens == before // 2
    d.step([("o1", preps[0]), ("o2", preps[1])])  # the scheduler admits them again
    d.run()
    assert d.finals["o1"].outputs[0]["text"] == greedy(runner, "the man was", 8)
    assert d.finals["o2"].outputs[0]["text"] == greedy(runner, "a b c", 8)


def test_a_failing_step_fails_the_running_requests_and_the_engine_goes_on(
    runner: TextGenerationRunner,
) -> None:
    (p,) = prepare(runner, req("f", max_new_tokens=8))
    d = Driver(runner)
    d.step([("f", p)])

    def broken() -> Any:
        runner.engine.step = real
        raise RuntimeError("a bug")

    real = runner.engine.step
    runner.engine.step = broken  # type: ignore[method-assign]
    report = runner.step(Work("bad", ()))
    assert [type(e).__name__ for e in report.events] == ["Failed"] and not report.out_of_memory
    (q,) = prepare(runner, req("g", max_new_tokens=5))
    d.step([("g", q)])
    d.run()
    assert d.finals["g"].outputs[0]["text"] == greedy(runner, "the man was", 5)


def test_malloc_keeps_freed_memory_on_glibc() -> None:
    import platform

    from batchfleet.worker.device import keep_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert keep_freed_memory()


def test_a_step_budget_changed_live_reaches_the_engine(runner: TextGenerationRunner) -> None:
    (p,) = prepare(runner, req("b", max_new_tokens=3))
    runner.step(Work("s1", (("b", p),), step_tokens=32))
    assert runner.step_tokens == 32 and runner.engine.step_tokens == 32  # type: ignore[attr-defined]
    runner.step(Work("s2", ()))  # None: as it was
    assert runner.step_tokens == 32


def test_out_of_memory_releases_memory_after_the_failed_step_is_gone(
    runner: TextGenerationRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    import weakref

    from batchfleet.worker.runners import gen_failures as generation

    class Activations:
        pass

    held: list[weakref.ref[Activations]] = []
    alive_at_release: list[bool] = []

    def oom() -> Any:
        activations = Activations()  # the failed step's tensors, alive in its frame
        held.append(weakref.ref(activations))
        raise MemoryError("out of memory (fake)")

    monkeypatch.setattr(generation, "release_cached_memory",
                        lambda device: alive_at_release.append(held[0]() is not None))  # fmt: skip
    (prep,) = prepare(runner, req("m1", max_new_tokens=4))
    Driver(runner).step([("m1", prep)])
    runner.engine.step = oom  # type: ignore[method-assign]
    report = runner.step(Work("boom", ()))
    # Then the cached memory is given back once the failed step's frame (and what it
    # held) is freed, not from inside the except clause
    assert report.out_of_memory and alive_at_release == [False]


def test_forget_all_starts_over_a_request_read_again(runner: TextGenerationRunner) -> None:
    # a crashed loop restarts and reads its requests again, under the same keys
    d = Driver(runner)
    (p,) = prepare(runner, req("a", max_new_tokens=12))
    d.step([("a", p)])
    d.step()
    runner.forget_all()
    assert not runner._reqs and not runner._by_seq
    (p,) = prepare(runner, req("a", max_new_tokens=12))
    d.step([("a", p)])
    d.run()
    out = d.finals["a"].outputs[0]
    assert out["completion_tokens"] == 12 and out["text"] == greedy(runner, "the man was", 12)
    assert runner.engine.step() == []  # nothing of its first life is left in the engine


def test_a_request_lost_to_another_worker_ends_without_streaming_its_rest(
    runner: TextGenerationRunner,
) -> None:
    # a stop string holds the text's last characters back: ending it flushes them, unless
    # another worker took the request over (nobody reads this worker's stream any more)
    def end(reason: str) -> tuple[int, int]:
        (p,) = prepare(runner, req("l", max_new_tokens=30, stream=True, stop=["zzzzzz"]))
        d = Driver(runner)
        for k in range(4):
            d.step([("l", p)] if k == 0 else ())
        sent = len(d.partials["l"])
        d.step(stop=[("l", reason)])
        assert "l" in d.finals and not runner._reqs
        return sent, len(d.partials["l"])

    sent, after = end("cancelled")
    assert after == sent + 1
    assert end(LOST) == (sent, sent)
