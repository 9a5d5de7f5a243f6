"""vLLM's metrics (``vllm:*``) of a generating model: a tiny model's requests run through
the loop in virtual time, the loop's events fed to the worker's observers, and each
vLLM series checked against its ``batchfleet_*`` twin and against the results."""

from __future__ import annotations

import threading
import urllib.request
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.messages import Request, Result  # noqa: E402
from batchfleet.worker.metrics import Metrics, PrometheusObserver, prometheus_metrics  # noqa: E402
from batchfleet.worker.observers import Answered, Generated, Observers  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from batchfleet.worker.vllm_info import VllmInfoCollector  # noqa: E402
from batchfleet.worker.vllm_metrics import (  # noqa: E402
    FINISHED_REASONS,
    PROMPT_SOURCES,
    TTFT_BUCKETS,
    WAITING_REASONS,
    VllmMetrics,
    VllmObserver,
)
from prometheus_client import CollectorRegistry  # noqa: E402
from virtual_world import MODEL, T0, Rig, rig  # noqa: E402

from batchfleet.config import FleetConfig  # noqa: E402

STEP_S = 0.010
LONG = ("the man was here and we can do all that " * 4).rstrip()
"""65 tokens: repeated, all but its last are cached (4 pages of 16)."""
VLLM = {"model_name": MODEL, "engine": "0"}
FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter", "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram", "vllm:request_params_max_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:spec_decode_num_drafts": "counter", "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
    "vllm:num_requests_waiting_by_reason": "gauge", "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached": "counter", "vllm:prompt_tokens_recomputed": "counter",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
}  # fmt: skip
EXTRA_LABEL = {"vllm:spec_decode_num_accepted_tokens_per_pos": "position",
               "vllm:request_success": "finished_reason",
               "vllm:prompt_tokens_by_source": "source",
               "vllm:num_requests_waiting_by_reason": "reason"}  # fmt: skip


@pytest.fixture(scope="module")
def runner(tiny_lm: Path) -> TextGenerationRunner:
    """n-gram speculative decoding: a tiny random model's greedy text repeats itself, so
    steps propose drafts and some are accepted."""
    opts = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 16,
            "engine": "padded", "prefix_cache_tokens": 512,
            "speculative": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3}}  # fmt: skip
    return TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32", options=opts)


def third_token(runner: TextGenerationRunner, text: str) -> int:
    """The greedy continuation's third token (a stop token that ends it with ``stop``)."""
    ids = runner.tokenizer(text, return_tensors="pt").input_ids.to(runner.torch_device)
    out = runner.model.generate(ids, max_new_tokens=3, do_sample=False,
                                pad_token_id=runner.eos[0])  # fmt: skip
    return int(out[0, ids.shape[1] + 2])


def run_requests(runner: TextGenerationRunner) -> tuple[Rig, dict[str, Result]]:
    r = rig(runner, cost=lambda work: STEP_S)  # type: ignore[arg-type]
    reqs = [
        Request(id="len", model=MODEL, inputs=[LONG], max_new_tokens=7, ignore_eos=True),
        Request(id="again", model=MODEL, inputs=[LONG], max_new_tokens=2, ignore_eos=True),
        Request(id="two", model=MODEL, inputs=["it was the time", "we can do"], n=2,
                max_new_tokens=4, ignore_eos=True),
        Request(id="stop", model=MODEL, inputs=["the man was"], ignore_eos=True,
                stop_token_ids=[third_token(runner, "the man was")]),
        Request(id="late", model=MODEL, inputs=["all that we"], ignore_eos=True,
                max_new_tokens=200, deadline_ms=60),
        Request.model_construct(id="bad", model=MODEL, inputs=["the man"], max_new_tokens=10**6),
    ]  # fmt: skip
    for k, req in enumerate(reqs):  # "again" once "len" has ended: its prompt is cached
        r.source.add(req, lane=k % 3, at=T0 + (0.5 if req.id == "again" else 0.003 * k))
    r.run()
    return r, r.results()


def observed(r: Rig, vllm: bool = True) -> CollectorRegistry:
    """The run's loop events fed to a fresh registry's observers, as a worker feeds them."""
    registry = CollectorRegistry()
    observers: list[Any] = [PrometheusObserver(Metrics(registry))]
    if vllm:
        observers.append(VllmObserver(VllmMetrics(registry), MODEL, generating=True))
    obs = Observers(observers)
    for _, ev in r.recorder.events:
        obs.notify(ev)
    return registry


def test_vllm_series_agree_with_their_twins_and_the_results(runner: TextGenerationRunner) -> None:
    # Given: a run with every ending (length, stop, n=2 over two inputs, a deadline, a bad one)
    r, results = run_requests(runner)
    registry = observed(r)

    def vllm(name: str, **labels: str) -> float:
        v = registry.get_sample_value(name, {**VLLM, **labels})
        assert v is not None, (name, labels)
        return v

    def ours(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"model": MODEL, **labels}) or 0.0

    ok = [res for res in results.values() if res.status == "ok"]
    outs = [g for res in ok for g in res.generations()]
    reasons = Counter(g.finish_reason for g in outs)
    assert reasons == {"length": 6, "stop": 1, "deadline": 1}
    assert results["bad"].status == "error"  # refused, as vLLM's frontend would: not counted

    # Then: each family has vLLM's name, type and labels
    types = {m.name: m.type for m in registry.collect() if m.name.startswith("vllm:")}
    assert types == FAMILIES
    for metric in registry.collect():
        extra = {EXTRA_LABEL[metric.name]} if metric.name in EXTRA_LABEL else set()
        for s in metric.samples:
            if metric.name.startswith("vllm:"):
                assert set(s.labels) - {"le"} == {"model_name", "engine", *extra}, s

    # token counts: exact, and the twins'
    completion = sum(g.completion_tokens for g in outs)
    prompts = sum(res.usage.prompt_tokens for res in ok if res.usage)
    cached = sum(res.usage.prompt_tokens_details.cached_tokens for res in ok
                 if res.usage and res.usage.prompt_tokens_details)  # fmt: skip
    assert vllm("vllm:generation_tokens_total") == completion
    assert ours("batchfleet_step_generated_tokens_total") == completion
    assert prompts == ours("batchfleet_prompt_tokens_total")  # usage: each prompt once
    assert cached == ours("batchfleet_prompt_cached_tokens_total")
    # vLLM's: per completion (parallel sampling makes each of n a request with its prompt,
    # cached after its twin's prefill): "two"'s second completions add their prompts
    twins = results["two"].generations()[1::2]
    prompts += sum(g.prompt_tokens for g in twins)
    cached += sum(g.cached_tokens for g in twins)
    assert vllm("vllm:prompt_tokens_total") == prompts == sum(g.prompt_tokens for g in outs)
    assert vllm("vllm:prefix_cache_queries_total") == prompts
    assert vllm("vllm:prefix_cache_hits_total") == cached > 0
    # by source, as vLLM's: computed or cached, a fully cached prompt's last token in both
    # ("again" repeats "len", cached but for its last token)
    again = results["again"].generations()[0]
    assert again.cached_tokens == again.prompt_tokens - 1
    assert vllm("vllm:prompt_tokens_recomputed_total") == 1
    by_source = {k: vllm("vllm:prompt_tokens_by_source_total", source=k) for k in PROMPT_SOURCES}
    assert by_source == {"local_compute": prompts - cached, "local_cache_hit": cached + 1,
                         "external_kv_transfer": 0}  # fmt: skip
    assert vllm("vllm:prompt_tokens_cached_total") == cached
    # per engine step: the prompt tokens it prefilled (whose prefill it ended, cached ones
    # left out: every sequence's, n's twins too) and the tokens it generated
    computed = sum(g.prompt_tokens - g.cached_tokens for g in outs)
    steps = sum(isinstance(ev, Generated) for _, ev in r.recorder.events)
    assert vllm("vllm:iteration_tokens_total_count") == steps
    assert vllm("vllm:iteration_tokens_total_sum") == computed + completion
    assert ours("batchfleet_step_prefill_tokens_total") == computed
    # per output, the prompt tokens its sequence prefilled
    assert vllm("vllm:request_prefill_kv_computed_tokens_count") == len(outs)
    assert vllm("vllm:request_prefill_kv_computed_tokens_sum") == computed
    # ("again", and the second completion of each of "two"'s inputs: its twin prefilled it)
    assert vllm("vllm:request_prefill_kv_computed_tokens_bucket", le="1.0") == 3

    # success by vLLM's finished_reason: one per output (vLLM's engine requests)
    success = {k: vllm("vllm:request_success_total", finished_reason=k) for k in FINISHED_REASONS}
    assert success == {"stop": 1, "length": 6, "abort": 1, "error": 0, "repetition": 0}

    # histograms: one observation per output, their sums the results'
    n_out = len(outs)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):  # fmt: skip
        assert vllm(f"vllm:{name}_count") == n_out, name
    per_out = [(res, g) for res in ok for g in res.generations()]
    assert vllm("vllm:request_generation_tokens_sum") == completion
    assert vllm("vllm:request_prompt_tokens_sum") == sum(g.prompt_tokens for g in outs)
    assert vllm("vllm:time_to_first_token_seconds_sum") == pytest.approx(
        sum(res.timings.first_token_ms / 1000 for res, _ in per_out if res.timings.first_token_ms)
    )
    assert vllm("vllm:e2e_request_latency_seconds_sum") == pytest.approx(
        sum(res.timings.total_ms / 1000 for res, _ in per_out)
    )
    # the phases add up: inference = prefill + decode; queue + prefill = time to first token
    inference = vllm("vllm:request_inference_time_seconds_sum")
    prefill = vllm("vllm:request_prefill_time_seconds_sum")
    assert inference == pytest.approx(prefill + vllm("vllm:request_decode_time_seconds_sum"))
    assert inference == pytest.approx(sum(res.timings.inference_ms / 1000 for res, _ in per_out))
    assert vllm("vllm:request_queue_time_seconds_sum") + prefill == pytest.approx(
        vllm("vllm:time_to_first_token_seconds_sum")
    )
    assert prefill > 0
    per_token = 0.0
    for res, g in per_out:
        t = res.timings
        assert t.first_token_ms is not None
        decode = t.inference_ms - (t.first_token_ms - t.queued_ms - t.batch_wait_ms)
        per_token += decode / 1000 / (g.completion_tokens - 1) if g.completion_tokens > 1 else 0
    assert vllm("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(per_token)
    # n: once per input (two inputs with n=2, four with 1); max_tokens where it was asked,
    # per output ("stop" asked none)
    assert (vllm("vllm:request_params_n_count"), vllm("vllm:request_params_n_sum")) == (6, 8)
    # and the most tokens one of an input's completions took ("two": 4 each, two inputs)
    most = sum(g.completion_tokens for g in outs) - 2 * 4
    assert vllm("vllm:request_max_num_generation_tokens_count") == 6
    assert vllm("vllm:request_max_num_generation_tokens_sum") == most
    assert vllm("vllm:request_params_max_tokens_count") == n_out - 1
    assert vllm("vllm:request_params_max_tokens_sum") == 7 + 2 + 4 * 4 + 200
    # the same first-token times as the per-lane twin's (each request's, once per output)
    ttft_ours = sum(ours("batchfleet_time_to_first_token_seconds_sum", lane=str(k))
                    for k in range(3))  # fmt: skip
    two = results["two"].timings.first_token_ms
    assert two is not None
    assert vllm("vllm:time_to_first_token_seconds_sum") == pytest.approx(ttft_ours + 3 * two / 1000)
    # inter-token latency: the twin's gaps, all lanes together, in vLLM's buckets
    itl = [ours(f"batchfleet_inter_token_latency_seconds_{s}", lane=str(k))
           for s in ("count", "sum") for k in range(3)]  # fmt: skip
    assert vllm("vllm:inter_token_latency_seconds_count") == sum(itl[:3]) > 0
    assert vllm("vllm:inter_token_latency_seconds_sum") == pytest.approx(sum(itl[3:]))
    assert vllm("vllm:inter_token_latency_seconds_bucket", le="0.01") == vllm(
        "vllm:inter_token_latency_seconds_count"
    )  # every gap is one 10 ms step
    # the deprecated names vLLM's example dashboard plots: the same values
    for s in ("count", "sum"):
        assert vllm(f"vllm:time_per_output_token_seconds_{s}") == vllm(
            f"vllm:inter_token_latency_seconds_{s}"
        )
    assert vllm("vllm:gpu_cache_usage_perc") == vllm("vllm:kv_cache_usage_perc")
    # why requests wait: for room (the waiting twin), or their constraint (none here)
    assert vllm("vllm:num_requests_waiting_by_reason", reason="capacity") == ours(
        "batchfleet_generation_waiting_requests"
    )
    assert vllm("vllm:num_requests_waiting_by_reason", reason="deferred") == 0

    # scheduler state and speculative decoding: the twins' values
    for name, twin in (("num_requests_running", "batchfleet_generation_running_sequences"),
                       ("num_requests_waiting", "batchfleet_generation_waiting_requests"),
                       ("kv_cache_usage_perc", "batchfleet_kv_cache_usage_ratio"),
                       ("num_preemptions_total", "batchfleet_preemptions_total"),
                       ("spec_decode_num_drafts_total", "batchfleet_spec_decode_num_drafts_total"),
                       ("spec_decode_num_draft_tokens_total",
                        "batchfleet_spec_decode_num_draft_tokens_total"),
                       ("spec_decode_num_accepted_tokens_total",
                        "batchfleet_spec_decode_num_accepted_tokens_total")):  # fmt: skip
        assert vllm(f"vllm:{name}") == ours(twin), name
    assert vllm("vllm:spec_decode_num_accepted_tokens_total") > 0
    for pos in range(3):
        assert vllm("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == (
            ours("batchfleet_spec_decode_num_accepted_tokens_per_pos_total", position=str(pos))
        )


def test_the_paged_engine_reports_its_prefill_and_its_prefix_cache(tiny_lm: Path) -> None:
    # Given: the paged engine (transformers' block sharing); a prompt, then it again once
    # the first has ended, beside a short one
    opts = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 16,
            "engine": "paged"}  # fmt: skip
    paged = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32", options=opts)
    r = rig(paged, cost=lambda work: STEP_S)  # type: ignore[arg-type]
    for k, (id_, text, at) in enumerate((("first", LONG, 0.0), ("short", "we can do", 0.001),
                                         ("again", LONG, 0.5))):  # fmt: skip
        r.source.add(Request(id=id_, model=MODEL, inputs=[text], max_new_tokens=5,
                             ignore_eos=True), lane=k, at=T0 + at)  # fmt: skip
    r.run()
    results = r.results()
    registry = observed(r)

    def vllm(name: str, **labels: str) -> float:
        v = registry.get_sample_value(name, {**VLLM, **labels})
        assert v is not None, (name, labels)
        return v

    # Then: "again" took all of its prompt but the last token from the cache
    outs = {k: res.generations()[0] for k, res in results.items()}
    assert [g.completion_tokens for g in outs.values()] == [5, 5, 5]
    assert (outs["first"].cached_tokens, outs["again"].cached_tokens) == (0, 64)
    prompts = sum(g.prompt_tokens for g in outs.values())
    computed = prompts - 64
    assert vllm("vllm:prompt_tokens_cached_total") == 64
    assert vllm("vllm:prompt_tokens_recomputed_total") == 1
    assert vllm("vllm:prompt_tokens_by_source_total", source="local_compute") == computed
    assert vllm("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 65
    # each step's prefilled and generated tokens; each request's prefilled ones
    assert vllm("vllm:iteration_tokens_total_sum") == computed + 15
    assert vllm("vllm:request_prefill_kv_computed_tokens_sum") == computed
    assert vllm("vllm:request_prefill_kv_computed_tokens_bucket", le="1.0") == 1


@pytest.mark.parametrize(("cache", "rounds"), [(0, [65, 66 + 66, 67 + 67]),
                                               (512, [65, 66 - 64 + 66 - 64, 67 - 64 + 67 - 64])])  # fmt: skip
def test_a_beam_search_s_rounds_count_their_prefill(
    tiny_lm: Path, cache: int, rounds: list[int]
) -> None:
    # Given: a beam search of width 2 over 3 tokens, each round's beams a prompt of their
    # own (the prompt and the beam's tokens, as vLLM's beam search makes them engine
    # requests); with a prefix cache, the later rounds take the prompt's 4 whole pages
    opts = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 16,
            "engine": "padded", "prefix_cache_tokens": cache}  # fmt: skip
    beams = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32", options=opts)
    r = rig(beams, cost=lambda work: STEP_S)  # type: ignore[arg-type]
    r.source.add(Request(id="b", model=MODEL, inputs=[LONG], use_beam_search=True, n=2,
                         max_new_tokens=3, ignore_eos=True), lane=0, at=T0)  # fmt: skip
    r.run()
    outs = r.results()["b"].generations()
    assert [(g.prompt_tokens, g.cached_tokens, g.completion_tokens) for g in outs] == [
        (65, 0, 3)
    ] * 2
    registry = observed(r)

    def sample(name: str, labels: dict[str, str]) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    # Then: each step counts the rounds' tokens it prefilled, cached ones left out
    prefilled = sum(rounds)
    generated = sample("batchfleet_step_generated_tokens_total", {"model": MODEL})
    assert sample("batchfleet_step_prefill_tokens_total", {"model": MODEL}) == prefilled
    assert sample("vllm:iteration_tokens_total_sum", VLLM) == prefilled + generated
    # and each output its prompt's (its first round's)
    assert sample("vllm:request_prefill_kv_computed_tokens_sum", VLLM) == 2 * 65


def test_the_gauges_follow_the_steps_and_engine_errors_count_as_error() -> None:
    from batchfleet.schemas.errors import ErrorCode
    from batchfleet.schemas.messages import ErrorInfo
    from batchfleet.worker.observers import Reply

    registry = CollectorRegistry()
    obs = VllmObserver(VllmMetrics(registry), MODEL, generating=False)
    failed = Result(id="f", model=MODEL, status="error",
                    error=ErrorInfo(code=ErrorCode.INFERENCE_FAILED, message="boom"))  # fmt: skip
    request = Request(id="f", model=MODEL, inputs=["a", "b"], n=3)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {**VLLM, **labels})

    # a custom runner's model is not known to generate until its first step
    obs.notify(Answered(MODEL, [Reply(0, request, failed, True)]))
    assert value("vllm:request_success_total", finished_reason="error") is None
    obs.notify(Generated(MODEL, 6, 2, 300, 1200, 1, tokens=3, compiling=1, deferred=2,
                         admitting=1, prefilled=20))  # fmt: skip
    obs.notify(Answered(MODEL, [Reply(0, request, failed, True)]))
    assert value("vllm:request_success_total", finished_reason="error") == 6  # 2 inputs x 3
    # the sequences whose constraint compiles wait, as in vLLM's scheduler (deferred), and
    # so does the one a later step admits (planned ahead)
    assert (value("vllm:num_requests_running"), value("vllm:num_requests_waiting")) == (3, 5)
    by_reason = [value("vllm:num_requests_waiting_by_reason", reason=k) for k in WAITING_REASONS]
    assert by_reason == [3, 2]  # waiting for room or their step; for their constraints
    assert value("vllm:iteration_tokens_total_sum") == 23
    assert value("vllm:iteration_tokens_total_bucket", le="16.0") == 0
    assert value("vllm:iteration_tokens_total_bucket", le="32.0") == 1
    assert value("vllm:kv_cache_usage_perc") == value("vllm:gpu_cache_usage_perc") == 0.25
    assert value("vllm:num_preemptions_total") == 1
    assert value("vllm:time_to_first_token_seconds_count") == 0
    assert value("vllm:time_to_first_token_seconds_bucket", le=str(TTFT_BUCKETS[0])) == 0


def scheduling_runner(tiny_lm: Path, ahead: bool, max_running: int) -> TextGenerationRunner:
    """A runner without a prefix cache, its steps planned ahead or not."""
    return TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                options={"kv_cache_tokens": 2048, "page_size": 16,
                                         "step_tokens": 64, "max_running": max_running,
                                         "schedule_ahead": ahead})  # fmt: skip


@pytest.mark.parametrize("ahead", [True, False])
def test_requests_whose_constraint_compiles_wait_deferred_as_in_vllm(
    tiny_lm: Path, ahead: bool
) -> None:
    # Given a plain request and a constrained one with two completions whose constraint
    # compiles until the runner has stepped five times (held: no sleeps), and one more
    # arriving while they run; steps planned ahead or not
    runner = scheduling_runner(tiny_lm, ahead, max_running=16)
    gate, real_compile, real_step = threading.Event(), runner._grammars._compile, runner.step  # type: ignore[union-attr]
    ran: list[int] = []
    """After each step, the sequences the runner has in its engine (running)."""

    def held(spec: Any) -> Any:
        assert gate.wait(60)
        return real_compile(spec)

    def step(work: Any) -> Any:
        if len(ran) == 4:
            gate.set()
        report = real_step(work)
        ran.append(len(runner._by_seq))
        return report

    runner._grammars._compile = held  # type: ignore[union-attr,method-assign]
    runner.step = step  # type: ignore[method-assign]
    r = rig(runner, cost=lambda work: STEP_S)  # type: ignore[arg-type]
    r.source.add(Request(id="plain", model=MODEL, inputs=["the man was"], max_new_tokens=12,
                         ignore_eos=True), lane=0, at=T0)  # fmt: skip
    r.source.add(Request(id="shaped", model=MODEL, inputs=["a b c"], n=2, max_new_tokens=6,
                         structured_outputs={"regex": "[0-9]{4}"}), lane=0, at=T0)  # fmt: skip
    r.source.add(Request(id="late", model=MODEL, inputs=["it"], max_new_tokens=4,
                         ignore_eos=True), lane=0, at=T0 + 7.5 * STEP_S)  # fmt: skip

    # When it runs, each step's state feeding vLLM's gauges
    r.run()
    assert {k: v.status for k, v in r.results().items()} == dict.fromkeys(
        ("plain", "shaped", "late"), "ok"
    )
    registry = CollectorRegistry()
    obs = VllmObserver(VllmMetrics(registry), MODEL, generating=True)
    seen = []
    for _, ev in r.recorder.of(Generated):
        obs.notify(ev)
        get = registry.get_sample_value
        running, waiting = (
            get("vllm:num_requests_running", VLLM),
            get("vllm:num_requests_waiting", VLLM),
        )
        capacity, deferred = (get("vllm:num_requests_waiting_by_reason", {**VLLM, "reason": k})
                              for k in WAITING_REASONS)  # fmt: skip
        assert capacity is not None and deferred is not None
        assert capacity + deferred == waiting  # vLLM's: the reasons add up to waiting
        seen.append((ev.compiling, (running, waiting, deferred)))

    # Then at every step the running are the sequences that step ran, as vLLM's scheduler
    # counts after a step: none a later step admits, planned already (nor the constrained
    # ones, the step before their runner defers them); while its constraint compiles the
    # request's two sequences wait (deferred); once compiled they run
    assert [gauges[0] for _, gauges in seen] == ran
    assert seen[0] == (0, (1, 2, 0))  # the plain one runs; the other is admitted next
    compiling = [k for k, (n, _) in enumerate(seen) if n]
    assert len(compiling) >= 3 and {seen[k][1][2] for k in compiling} == {2}
    assert compiling == list(range(1, compiling[-1] + 1))  # from the step after it came
    running, _, deferred = seen[compiling[-1] + 1][1]
    assert running >= 2 and not deferred  # compiled: its two sequences run


@pytest.mark.parametrize("ahead", [True, False])
def test_each_of_n_completions_counts_as_a_vllm_request_waiting_and_running(
    tiny_lm: Path, ahead: bool
) -> None:
    # Given a batch of four sequences that one request's three completions fill, and two
    # more requests with n=3 behind it (3 + 3 > 4: each waits for the one before to end)
    runner = scheduling_runner(tiny_lm, ahead, max_running=4)
    r = rig(runner, cost=lambda work: STEP_S)  # type: ignore[arg-type]
    for k, name in enumerate(("first", "second", "third")):
        r.source.add(Request(id=name, model=MODEL, inputs=["the man was"], n=3,
                             max_new_tokens=4 + k, ignore_eos=True), lane=0, at=T0)  # fmt: skip

    # When they run, each step's state feeding vLLM's gauges and the worker's own
    r.run()
    assert {k: v.status for k, v in r.results().items()} == dict.fromkeys(
        ("first", "second", "third"), "ok"
    )
    registry = CollectorRegistry()
    obs = Observers([VllmObserver(VllmMetrics(registry), MODEL, generating=True),
                     PrometheusObserver(Metrics(registry))])  # fmt: skip
    seen = []
    for _, ev in r.recorder.of(Generated):
        obs.notify(ev)
        get = registry.get_sample_value
        gauges = tuple(get(f"vllm:num_requests_{k}", VLLM) for k in ("running", "waiting"))
        capacity = get("vllm:num_requests_waiting_by_reason", {**VLLM, "reason": "capacity"})
        assert capacity == gauges[1]  # no constraint: every one waits for room
        ours = get("batchfleet_generation_waiting_requests", {"model": MODEL})
        seen.append((gauges, ours))

    # Then, as vLLM's parallel sampling makes each completion a request of its scheduler,
    # both gauges count completions: three run while six wait; once a request ends its
    # three wait with the others until the next step runs them (vLLM counts after a step)
    gauges = [g for k, (g, _) in enumerate(seen) if k == 0 or g != seen[k - 1][0]]
    assert gauges == [(3, 6), (0, 6), (3, 3), (0, 3), (3, 0), (0, 0)]
    assert seen[0] == ((3, 6), 2)  # the worker's own gauge counts the requests


def test_a_waiting_beam_search_counts_its_inputs_as_vllm_s_first_round(tiny_lm: Path) -> None:
    # Given a batch that three completions fill, and a beam search of width 2 over two
    # prompts behind it (4 beams: it waits); vLLM's beam search sends each prompt's
    # first round as one request (one beam), the later rounds one per beam
    r = rig(scheduling_runner(tiny_lm, False, max_running=4), cost=lambda work: STEP_S)  # type: ignore[arg-type]
    r.source.add(Request(id="first", model=MODEL, inputs=["the man was"], n=3,
                         max_new_tokens=4, ignore_eos=True), lane=0, at=T0)  # fmt: skip
    r.source.add(Request(id="beams", model=MODEL, inputs=["a", "b"], use_beam_search=True,
                         n=2, max_new_tokens=2, ignore_eos=True), lane=0, at=T0)  # fmt: skip
    r.run()
    registry = CollectorRegistry()
    obs = VllmObserver(VllmMetrics(registry), MODEL, generating=True)
    _, first = r.recorder.of(Generated)[0]
    obs.notify(first)
    # Then, while "first" runs, the beam search waits as its two prompts
    assert registry.get_sample_value("vllm:num_requests_running", VLLM) == 3
    assert registry.get_sample_value("vllm:num_requests_waiting", VLLM) == 2


def greedy(runner: TextGenerationRunner, text: str, tokens: int) -> list[int]:
    """The first ``tokens`` tokens of ``text``'s greedy continuation."""
    ids = runner.tokenizer(text, return_tensors="pt").input_ids.to(runner.torch_device)
    out = runner.model.generate(ids, max_new_tokens=tokens, do_sample=False,
                                pad_token_id=runner.eos[0])  # fmt: skip
    return [int(t) for t in out[0, ids.shape[1] :]]


@pytest.mark.parametrize("ahead", [True, False])
def test_a_sequence_preempted_alone_waits_as_one_while_its_request_runs(
    tiny_lm: Path, ahead: bool
) -> None:
    # Given a batch of three sequences that a lane-2 request of three inputs fills, the
    # first of which ends with its first token (its stop token, which the others never
    # write), and a lane-0 request of two completions arriving once it ended (2 + 2 > 3)
    runner = scheduling_runner(tiny_lm, ahead, max_running=3)
    inputs = ["the man was", "it was the time", "we can do"]
    stop = greedy(runner, inputs[0], 1)[0]
    assert all(stop not in greedy(runner, text, 12) for text in inputs[1:])
    r = rig(runner, cost=lambda work: STEP_S)  # type: ignore[arg-type]
    r.source.add(Request(id="low", model=MODEL, inputs=inputs, max_new_tokens=12,
                         ignore_eos=True, stop_token_ids=[stop]), lane=2, at=T0)  # fmt: skip
    r.source.add(Request(id="high", model=MODEL, inputs=["a b c"], n=2, max_new_tokens=3,
                         ignore_eos=True), lane=0, at=T0 + 3.5 * STEP_S)  # fmt: skip

    # When they run, each step's state feeding vLLM's gauges
    r.run()
    results = r.results()
    assert {k: v.status for k, v in results.items()} == {"low": "ok", "high": "ok"}
    low = [(g.finish_reason, g.completion_tokens) for g in results["low"].generations()]
    assert low == [("stop", 1), ("length", 12), ("length", 12)]  # resumed without loss
    registry = CollectorRegistry()
    obs = VllmObserver(VllmMetrics(registry), MODEL, generating=True)
    seen = []
    for _, ev in r.recorder.of(Generated):
        obs.notify(ev)
        get = registry.get_sample_value
        running, waiting, usage = (get(f"vllm:{k}", VLLM) for k in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))  # fmt: skip
        seen.append((ev, running, waiting, usage))

    # Then after the step that preempted one of its sequences, as vLLM's scheduler after
    # its step (a child request freed alone and put back at the front of its waiting
    # queue, the other running on): that sequence waits (not its request's inputs),
    # "high"'s two and "low"'s other unfinished one run, and the cache holds only theirs;
    # the preemption is counted once, as one sequence
    (k,) = [k for k, (ev, *_) in enumerate(seen) if ev.preempted]
    ev, running, waiting, usage = seen[k]
    assert (ev.waiting, running, waiting) == (0, 3, 1)  # no request waits, one sequence
    assert usage == ev.kv_tokens / ev.kv_capacity > 0
    # (each of "high"'s completions holds its prompt, its first token not yet written;
    # "low"'s running sequence its prompt and the tokens it made)
    assert ev.kv_tokens > 2 * len(runner.tokenizer("a b c").input_ids)
    assert registry.get_sample_value("vllm:num_preemptions_total", VLLM) == 1
    # after the first step the three inputs less the one that ended run; at the end none
    assert seen[0][1:3] == (2, 0)
    assert seen[-1][1:3] == (0, 0)


def test_an_input_s_longest_completion_is_its_max_num_generation_tokens() -> None:
    from batchfleet.schemas.messages import Generation, Usage
    from batchfleet.worker.observers import Reply

    registry = CollectorRegistry()
    obs = VllmObserver(VllmMetrics(registry), MODEL, generating=True)
    lengths = [3, 9, 5, 2]  # input 0: 3 and 9; input 1: 5 and 2
    outs = [Generation(text="", finish_reason="stop", prompt_tokens=4, completion_tokens=k)
            for k in lengths]  # fmt: skip
    result = Result(id="r", model=MODEL, status="ok", outputs=outs,
                    usage=Usage(prompt_tokens=8, completion_tokens=sum(lengths)))  # fmt: skip
    request = Request(id="r", model=MODEL, inputs=["a", "b"], n=2)
    obs.notify(Answered(MODEL, [Reply(0, request, result, True)]))

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, VLLM)

    assert value("vllm:request_max_num_generation_tokens_count") == 2
    assert value("vllm:request_max_num_generation_tokens_sum") == 9 + 5
    assert value("vllm:request_generation_tokens_sum") == sum(lengths)
    assert value("vllm:request_params_max_tokens_count") == 0  # none asked
    assert value("vllm:time_to_first_token_seconds_count") == 0  # no first token: not timed
    # each completion's prompt, as vLLM's child requests (its usage counts each prompt once)
    assert value("vllm:prompt_tokens_total") == 16
    # a custom runner's outputs that tell no prompt tokens: its usage's
    bare = result.model_copy(update={"id": "s", "outputs": [{"text": ""}] * 4})
    obs.notify(Answered(MODEL, [Reply(0, request, bare, True)]))
    assert value("vllm:prompt_tokens_total") == 16 + 8


def test_cache_config_and_lora_info_are_read_off_the_runner(runner: TextGenerationRunner) -> None:
    lora_runner = SimpleNamespace(lora_requests=lambda queued: {"chat": (0, 2), "sql": (1, 0)},
                                  max_loras=4)  # fmt: skip
    loops = [SimpleNamespace(model=MODEL, runner=runner),
             SimpleNamespace(model="other", runner=lora_runner)]  # fmt: skip
    registry = CollectorRegistry()
    registry.register(VllmInfoCollector(lambda: loops))
    families = {m.name: m for m in registry.collect()}
    (cache,) = families["vllm:cache_config_info"].samples
    assert cache.value == 1
    assert cache.labels == {"block_size": "16", "cache_dtype": "float32", "num_gpu_blocks": "128",
                            "enable_prefix_caching": "True", "engine": "0", "model_name": MODEL}  # fmt: skip
    (lora,) = families["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": "4", "running_lora_adapters": "sql",
                           "waiting_lora_adapters": "chat", "model_name": "other"}  # fmt: skip
    assert lora.value > 1.7e9  # when it was read (vLLM's: a timestamp)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_worker_serves_them_on_its_metrics_port_unless_turned_off(
    redis_url: str, enabled: bool
) -> None:
    fleet = FleetConfig(redis_url=redis_url,
                        models={MODEL: {"runner": "text-generation"}, "emb": {}},
                        metrics={"port": 0, "address": "127.0.0.1", "vllm": enabled})  # fmt: skip
    worker = SimpleNamespace(app=SimpleNamespace(batchfleet_models=[MODEL, "emb"]), steps=())
    gen = prometheus_metrics(worker, fleet, MODEL)
    emb = prometheus_metrics(worker, fleet, "emb")
    server = worker._batchfleet_metrics
    try:
        assert isinstance(gen, Observers if enabled else PrometheusObserver)
        assert isinstance(emb, PrometheusObserver)  # an encoder: its own metrics only
        with urllib.request.urlopen(server.url.replace("0.0.0.0", "127.0.0.1"), timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.close()
    line = (
        f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{MODEL}"}} 0.0'
    )
    assert (line in text) is enabled
    assert ('model_name="emb"' in text) is False  # an encoder has none
    assert ("# TYPE vllm:time_to_first_token_seconds histogram" in text) is enabled


@pytest.mark.parametrize(
    ("top", "buckets"),
    [
        (1, (1,)),
        (4, (1, 2)),
        (100, (1, 2, 5, 10, 20, 50, 100)),
        (4096, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)),
    ],
)
def test_token_count_buckets_are_vllm_s_1_2_5(top: int, buckets: tuple[int, ...]) -> None:
    from batchfleet.worker.vllm_metrics import buckets_1_2_5

    assert buckets_1_2_5(top) == buckets
