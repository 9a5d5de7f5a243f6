"""Beam search (``use_beam_search``), run by the text-generation runner in engine rounds:
it gives the beams of a reference beam search that re-scores every hypothesis with a
full forward, and of HF ``generate(num_beams=...)`` where the two agree; width 1 is
greedy; it runs beside plain requests, and ends early when cancelled or past a deadline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import WorkerProcess, fleet_toml
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.messages import Request  # noqa: E402
from batchfleet.worker.generation.beam import Beam, BeamSearch, score  # noqa: E402
from batchfleet.worker.generation.beam_rounds import draw_seed  # noqa: E402
from batchfleet.worker.runner import Prepared  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from test_generation_runner import Driver, greedy, prepare, req, run  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

PROMPTS = ["the man was", "there were many years of time and"]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture(params=["padded", "paged"])
def runner(  # blocks of 4 tokens: each round's prefix-cache hit ends mid-beam
    lm_dir: Path, request: pytest.FixtureRequest
) -> TextGenerationRunner:
    opts = {"kv_cache_tokens": 2048, "page_size": 4, "step_tokens": 64, "max_running": 16,
            "engine": request.param}  # fmt: skip
    return TextGenerationRunner(lm_dir, device=DEVICE, dtype="float32", options=opts)


def reference(
    runner: TextGenerationRunner, prompt: list[int], width: int, max_new: int,
    length_penalty: float = 1.0, ignore_eos: bool = False, stop_ids: frozenset[int] = frozenset(),
    temperature: float = 0.0, seed: int = 0,
) -> list[Beam]:  # fmt: skip
    """vLLM's beam search written out plainly, each hypothesis scored by a full forward of
    its whole sequence (no cache, no engine, none of the code under test). Above 0
    ``temperature``, each beam's round also draws a token from softmax(logits / T) with
    its own seeded generator, a candidate too, scored by its plain log-probability."""
    eos = frozenset() if ignore_eos else frozenset(runner.eos)

    def key(b: Beam) -> float:
        n = len(prompt) + len(b.tokens) - (1 if b.tokens[-1] in eos else 0)
        return b.logprob / float(n) ** length_penalty

    live, ended = [Beam((), 0.0)], []
    for rnd in range(max_new):
        grown = []
        for k, beam in enumerate(live):
            ids = torch.tensor([[*prompt, *beam.tokens]], device=runner.torch_device)
            with torch.no_grad():
                logits = runner.model(input_ids=ids).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            values, top = torch.topk(lp, 2 * width)
            candidates = list(zip(top.tolist(), values.tolist(), strict=True))
            if temperature > 0:
                gen = torch.Generator().manual_seed(draw_seed(seed, 0, rnd, k) or 0)
                probs = torch.softmax(logits.cpu() / temperature, -1)
                drawn = int(torch.multinomial(probs, 1, generator=gen))
                if drawn not in top.tolist():
                    candidates.append((drawn, float(lp[drawn])))
            for t, v in candidates:
                tokens, lp = (*beam.tokens, t), beam.logprob + v
                if t in eos:
                    ended.append(Beam(tokens, lp, "stop"))
                elif t in stop_ids:
                    ended.append(Beam(tokens, lp, "stop", t))
                else:
                    grown.append(Beam(tokens, lp))
        live = sorted(grown, key=key, reverse=True)[:width]
    ended += [Beam(b.tokens, b.logprob, "length") for b in live]
    return sorted(ended, key=key, reverse=True)[:width]


def shown(b: Beam) -> list[int]:
    """A beam's output ``token_ids``: an ending end-of-sequence token left out (vLLM's)."""
    return list(b.tokens[:-1] if b.finish == "stop" and b.stop_reason is None else b.tokens)


def ids_of(runner: TextGenerationRunner, text: str) -> list[int]:
    return list(runner.tokenizer(text).input_ids)


def beams(runner: TextGenerationRunner, rid: str = "b", **kw: Any) -> list[dict[str, Any]]:
    kw.setdefault("return_token_ids", True)
    kw.setdefault("use_beam_search", True)
    return run(runner, req(rid, **kw))[rid]


def test_beam_search_gives_the_reference_beams(runner: TextGenerationRunner) -> None:
    for penalty in (1.0, 0.0, 2.0):
        outs = beams(runner, inputs=PROMPTS, n=3, max_new_tokens=7, length_penalty=penalty)
        assert len(outs) == 6
        for i, text in enumerate(PROMPTS):
            want = reference(runner, ids_of(runner, text), 3, 7, penalty)
            got = outs[i * 3 : i * 3 + 3]
            assert [o["token_ids"] for o in got] == [shown(b) for b in want]
            assert [o["finish_reason"] for o in got] == [b.finish for b in want]
            assert [o["text"] for o in got] == [
                runner.tokenizer.decode(b.tokens, skip_special_tokens=True) for b in want
            ]
    if runner.engine_kind == "padded":  # the rounds take the prompt's blocks from the cache
        assert runner.engine.prefix is not None and runner.engine.prefix.hit_tokens > 0
        assert outs[0]["cached_tokens"] > 0  # (the last search's first round found it too)


def test_width_one_is_greedy(runner: TextGenerationRunner) -> None:
    (out,) = beams(runner, max_new_tokens=12)
    assert out["text"] == greedy(runner, "the man was", 12)


def test_ignore_eos_beams_equal_hf_generate_num_beams(runner: TextGenerationRunner) -> None:
    # Given no token ends a beam (HF without an eos, ours with ignore_eos), both keep the
    # width best of each round's 2 * width candidates and rank equal lengths alike
    prompt = ids_of(runner, PROMPTS[1])
    outs = beams(runner, inputs=[PROMPTS[1]], n=4, max_new_tokens=6, ignore_eos=True)
    ids = torch.tensor([prompt], device=runner.torch_device)
    hf = runner.model.generate(ids, num_beams=4, num_return_sequences=4, do_sample=False,
                               max_new_tokens=6, eos_token_id=None, length_penalty=1.0,
                               early_stopping=False, output_scores=True,
                               return_dict_in_generate=True)  # fmt: skip
    want = [row[len(prompt) :].tolist() for row in hf.sequences]
    assert [o["token_ids"] for o in outs] == want
    ref = reference(runner, prompt, 4, 6, ignore_eos=True)
    # HF's sequence score is the sum over the generated length
    assert [b.logprob / 6 for b in ref] == pytest.approx(hf.sequences_scores.tolist(), abs=1e-4)


@pytest.mark.parametrize("as_eos", [True, False])
@pytest.mark.parametrize("penalty", [0.0, 1.0, 3.0])
def test_a_token_that_ends_a_text_ends_a_beam(lm_dir: Path, as_eos: bool, penalty: float) -> None:
    # Given a token among the likeliest first tokens that ends a text: an end-of-sequence
    # token, or a stop token id
    runner = TextGenerationRunner(lm_dir, device=DEVICE, dtype="float32",
                                  options={"kv_cache_tokens": 1024, "page_size": 4})  # fmt: skip
    prompt = ids_of(runner, PROMPTS[0])
    with torch.no_grad():
        logits = runner.model(input_ids=torch.tensor([prompt], device=runner.torch_device))
    stop = int(torch.topk(logits.logits[0, -1], 2).indices[1])
    if as_eos:
        runner.eos.append(stop)
    kw: dict[str, Any] = {} if as_eos else {"stop_token_ids": [stop]}
    # When beams run
    outs = beams(runner, inputs=[PROMPTS[0]], n=2, max_new_tokens=5, length_penalty=penalty, **kw)
    want = reference(runner, prompt, 2, 5, penalty, stop_ids=frozenset({stop}))
    # Then the beam that took it ended there, ranked by its length (less an eos)
    assert [o["token_ids"] for o in outs] == [shown(b) for b in want]
    assert [(o["finish_reason"], o.get("stop_reason")) for o in outs] == [
        (b.finish, b.stop_reason) for b in want
    ]
    ended = [o for o in outs if o["token_ids"] == ([] if as_eos else [stop])]
    if penalty <= 1.0:  # (a high penalty ranks the short beam last)
        assert ended and ended[0]["finish_reason"] == "stop"
        assert ended[0].get("stop_reason") == (None if as_eos else stop)
        assert ended[0]["completion_tokens"] == (0 if as_eos else 1)
    # And include_stop_str_in_output keeps an ending end-of-sequence token (vLLM's)
    kept = beams(runner, inputs=[PROMPTS[0]], n=2, max_new_tokens=5, length_penalty=penalty,
                 include_stop_str_in_output=True, **kw)  # fmt: skip
    assert [o["token_ids"] for o in kept] == [list(b.tokens) for b in want]
    assert [o["completion_tokens"] for o in kept] == [len(b.tokens) for b in want]


def test_temperature_draws_a_candidate_that_can_only_end_a_beam(
    runner: TextGenerationRunner,
) -> None:
    # Given a hot, seeded beam request whose first round draws (for some seed) a token
    # outside the 2 likeliest, which is a stop token id
    prompt = ids_of(runner, PROMPTS[0])
    with torch.no_grad():
        ids = torch.tensor([prompt], device=runner.torch_device)
        logits = runner.model(input_ids=ids).logits[0, -1].float().cpu()  # (gen: on the CPU)
    likeliest = torch.topk(logits, 2).indices.tolist()
    hot = 50.0
    drawn = {}
    for seed in range(50):
        gen = torch.Generator().manual_seed(draw_seed(seed, 0, 0, 0) or 0)
        token = int(torch.multinomial(torch.softmax(logits / hot, -1), 1, generator=gen))
        if token not in likeliest:
            drawn[seed] = token
    seed, stop = next(iter(drawn.items()))
    kw: dict[str, Any] = dict(max_new_tokens=5, length_penalty=0.0, stop_token_ids=[stop])
    # When beams of width 1 run cold and hot
    (cold,) = beams(runner, **kw)
    hots = [beams(runner, rid=f"h{i}", temperature=hot, seed=seed, **kw) for i in range(2)]
    # Then hot, the drawn stop token ended a beam of one token, which (summed, the penalty
    # 0) beats the 5 tokens of the live one: not cold's beam
    want = reference(runner, prompt, 1, 5, 0.0, stop_ids=frozenset({stop}), temperature=hot,
                     seed=seed)  # fmt: skip
    assert [o["token_ids"] for o in hots[0]] == [shown(b) for b in want] == [[stop]]
    assert hots[0][0]["finish_reason"] == "stop" and hots[0][0]["stop_reason"] == stop
    assert hots[1] == hots[0]  # the same seed, the same beams
    assert cold["token_ids"] == shown(reference(runner, prompt, 1, 5, 0.0,
                                                stop_ids=frozenset({stop}))[0]) != [stop]  # fmt: skip
    # And a hot draw among the likeliest changes nothing: a seed whose draw is never a
    # stop token gives the cold beams (ranked by the model's own log-probabilities)
    (warm,) = beams(runner, rid="w", max_new_tokens=5, length_penalty=0.0, temperature=0.5,
                    seed=seed)  # fmt: skip
    (plain,) = beams(runner, rid="p", max_new_tokens=5, length_penalty=0.0)
    assert warm["token_ids"] == plain["token_ids"]


def test_each_round_s_draw_has_its_own_seed() -> None:
    seeds = [draw_seed(7, p, r, b) for p in range(2) for r in range(3) for b in range(2)]
    assert len(set(seeds)) == 12 and all(s is not None and 0 <= s < 2**63 for s in seeds)
    assert draw_seed(7, 1, 2, 1) == draw_seed(7, 1, 2, 1) != draw_seed(8, 1, 2, 1)
    assert draw_seed(None, 0, 0, 0) is None  # no seed: a random draw


def test_length_penalty_orders_beams_of_different_lengths() -> None:
    def search(penalty: float) -> list[Beam]:
        s = BeamSearch(
            2, 2, 3, penalty, frozenset({9}), lambda t: ("stop", None) if t[-1] == 9 else None
        )
        s.advance([[(9, -1.0), (1, -0.5), (2, -0.6)]])  # 9 ends a beam of one token
        s.advance([[(3, -0.5)], [(4, -0.1)]])
        s.advance([[(5, -0.2)], [(6, -0.1)]])  # live: (2, 4) -0.7 first, (1, 3) -1.0
        return s.best()

    # cumulative: (9,) -1.0 over 2 (the eos not counted); (2, 4, 5) -0.9 over 5;
    # (1, 3, 6) -1.1 over 5
    assert [b.tokens for b in search(0.0)] == [(2, 4, 5), (9,)]
    assert [b.tokens for b in search(1.0)] == [(2, 4, 5), (1, 3, 6)]
    assert [b.finish for b in search(1.0)] == ["length", "length"]
    assert search(0.0)[1].finish == "stop"


def test_a_beam_request_runs_beside_plain_requests(runner: TextGenerationRunner) -> None:
    out = run(runner, req("g1", max_new_tokens=9),
              req("b", use_beam_search=True, n=2, max_new_tokens=6, return_token_ids=True),
              req("g2", inputs=[PROMPTS[1]], max_new_tokens=9))  # fmt: skip
    assert out["g1"][0]["text"] == greedy(runner, "the man was", 9)
    assert out["g2"][0]["text"] == greedy(runner, PROMPTS[1], 9)
    want = reference(runner, ids_of(runner, "the man was"), 2, 6)
    assert [o["token_ids"] for o in out["b"]] == [shown(b) for b in want]
    assert not runner._beam_seqs and not runner._reqs


def test_a_stop_string_ends_a_beam_and_is_cut(runner: TextGenerationRunner) -> None:
    (free,) = beams(runner, max_new_tokens=10)
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    (out,) = beams(runner, max_new_tokens=10, stop=[stop])
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert stop not in out["text"] and text.startswith(out["text"])


@pytest.mark.parametrize("reason", ["cancelled", "deadline"])
def test_a_stopped_beam_request_ends_with_its_best_beams_so_far(
    runner: TextGenerationRunner, reason: str
) -> None:
    (p,) = prepare(runner, req("b", use_beam_search=True, n=3, max_new_tokens=40,
                               return_token_ids=True, ignore_eos=True))  # fmt: skip
    d = Driver(runner)
    d.step([("b", p)])
    for _ in range(4):
        d.step()
    assert runner._beam_seqs
    d.step(stop=[("b", reason)])
    outs = d.finals["b"].outputs
    assert len(outs) == 3 and {o["finish_reason"] for o in outs} == {reason}
    assert 0 < outs[0]["completion_tokens"] < 40
    assert not runner._beam_seqs and not runner._reqs
    assert all(runner.engine.state(name) is None for name in ("b#beam0.0", "b#beam0.5"))


def test_a_preempted_beam_request_resumes_to_the_same_beams(runner: TextGenerationRunner) -> None:
    kw: dict[str, Any] = dict(use_beam_search=True, n=2, max_new_tokens=8, return_token_ids=True)
    want = beams(runner, rid="w", **kw)
    (p,) = prepare(runner, req("b", **kw))
    d = Driver(runner)
    d.step([("b", p)])
    for _ in range(3):
        d.step()
    d.step(preempt=["b"])
    pre = d.preempted["b"]
    assert len(pre.prompts) == 2 and pre.max_new_tokens < 8
    assert not runner._beam_seqs
    d.step()
    d.step([("b", p)])
    d.run()
    assert [o["token_ids"] for o in d.finals["b"].outputs] == [o["token_ids"] for o in want]


def test_progress_reports_each_live_beam(runner: TextGenerationRunner) -> None:
    (p,) = prepare(runner, req("b", use_beam_search=True, n=3, max_new_tokens=10,
                               ignore_eos=True))  # fmt: skip
    assert isinstance(p, Prepared) and p.rows == 3 and len(p.prompts) == 3
    d = Driver(runner)
    d.step([("b", p)])
    for _ in range(4):
        d.step()
    report = d.reports[-1]
    report.settle()
    prog = report.progress["b"]
    assert len(prog.contexts) == 3 and prog.max_new_tokens_left < 10
    assert min(prog.contexts) > len(ids_of(runner, "the man was"))


def test_score_is_vllms() -> None:
    eos = frozenset({9})
    assert score(Beam((1, 2), -3.0), 4, 1.0, eos) == -0.5
    assert score(Beam((1, 9), -3.0), 4, 1.0, eos) == pytest.approx(-3.0 / 5)
    assert score(Beam((1, 2), -3.0), 4, 0.0, eos) == -3.0
    assert score(Beam((1, 2), -3.0), 4, 2.0, eos) == pytest.approx(-3.0 / 36)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"stream": True}, "not streamed"),
        ({"top_p": 0.7}, "top_p"),
        ({"logprobs": 2}, "logprobs"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty goes with"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(fields: dict[str, Any], message: str) -> None:
    body = {"id": "r", "model": "lm", "inputs": ["x"], "use_beam_search": True} | fields
    with pytest.raises(ValueError, match=message):
        Request.model_validate(body)
    for taken in ({"temperature": 0.0}, {"temperature": 0.7, "seed": 3}):  # (each round's draw)
        assert Request.model_validate(
            {"id": "r", "model": "lm", "inputs": ["x"], "use_beam_search": True} | taken
        ).use_beam_search


@pytest.mark.timeout(180)
def test_beam_search_through_a_worker(
    redis_url: str, r: Any, lm_dir: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    from test_generation_e2e import MODEL, result, submit

    opts = {"kv_cache_tokens": 2048, "page_size": 4, "step_tokens": 64, "max_running": 16}
    text = fleet_toml(redis_url, {MODEL: {"runner": "text-generation", "path": str(lm_dir),
                                          "options": opts}})  # fmt: skip
    start_worker(text, "gen-beam").wait_ready(r, MODEL)
    rid = submit(r, inputs=PROMPTS, n=2, max_new_tokens=5, use_beam_search=True,
                 length_penalty=0.5, return_token_ids=True)  # fmt: skip
    plain = submit(r, inputs=PROMPTS[:1], max_new_tokens=5)
    res = result(r, rid)
    assert res["status"] == "ok" and len(res["outputs"]) == 4
    local = TextGenerationRunner(lm_dir, device=DEVICE, dtype="float32", options=opts)
    for i, p in enumerate(PROMPTS):
        want = reference(local, ids_of(local, p), 2, 5, 0.5)
        got = res["outputs"][i * 2 : i * 2 + 2]
        assert [o["token_ids"] for o in got] == [shown(b) for b in want]
    assert result(r, plain)["outputs"][0]["text"] == greedy(local, PROMPTS[0], 5)
    bad = submit(r, inputs=["x"], use_beam_search=True, stream=True)
    err = result(r, bad)
    assert err["status"] == "error" and err["error"]["code"] == "invalid_request"
    assert "not streamed" in err["error"]["message"]


def test_the_model_info_tells_clients_the_workers_take_beam_search(lm_dir: Path) -> None:
    from batchfleet.schemas.messages import DEFAULT_LIMITS
    from batchfleet.schemas.model_info import decode_model_info
    from batchfleet.worker.runner_info import model_info

    gen = TextGenerationRunner(lm_dir, device="cpu", dtype="float32")
    info = decode_model_info(model_info(gen, DEFAULT_LIMITS, 1).model_dump_json())
    assert info.beam_search is True
    assert decode_model_info('{"task": "text-generation"}').beam_search is None  # an old one
