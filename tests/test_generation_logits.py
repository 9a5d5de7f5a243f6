"""A generation request's logits rules (repetition, presence and frequency penalties,
min_new_tokens) and log-probabilities through the runner on both engines: greedy output
equals HF ``generate`` with the same rules (or, for OpenAI's penalties, which ``generate``
lacks, a plain loop over full forwards), batched beside plain requests, across a
preemption and a restart; log-probabilities equal those of the model's own logits."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.errors import ErrorCode  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling, SeededSampler  # noqa: E402
from batchfleet.worker.runner import PrepareError  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from test_generation_runner import PROMPTS, Driver, greedy, prepare, req, run  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

OPTIONS = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 16}


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture(params=["padded", "paged"])
def runner(lm_dir: Path, request: pytest.FixtureRequest) -> TextGenerationRunner:
    return TextGenerationRunner(lm_dir, device=DEVICE, dtype="float32",
                                options={**OPTIONS, "engine": request.param})  # fmt: skip


def generate(runner: TextGenerationRunner, text: str, n: int, **rules: float) -> str:
    """HF ``generate``'s greedy text with its own logits processors for ``rules``."""
    ids = runner.tokenizer(text, return_tensors="pt").input_ids.to(runner.torch_device)
    out = runner.model.generate(ids, max_new_tokens=n, do_sample=False,
                                pad_token_id=runner.eos[0], **rules)  # fmt: skip
    return str(runner.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def hf_tokens(runner: TextGenerationRunner, text: str, n: int, **kw: Any) -> list[int]:
    """HF ``generate``'s greedy tokens for ``text`` (``kw``: its own options)."""
    ids = runner.tokenizer(text, return_tensors="pt").input_ids.to(runner.torch_device)
    out = runner.model.generate(ids, max_new_tokens=n, do_sample=False,
                                pad_token_id=runner.eos[0], **kw)  # fmt: skip
    return list(out[0, ids.shape[1] :].tolist())


def penalised(runner: TextGenerationRunner, text: str, n: int, presence: float,
              frequency: float) -> str:  # fmt: skip
    """Greedy with OpenAI's penalties, one full forward per token (the reference)."""
    ids = runner.tokenizer(text).input_ids
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            x = torch.tensor([ids + out], device=runner.torch_device)
            logits = runner.model(x).logits[0, -1].float().cpu()
            for t in set(out):
                logits[t] -= presence + frequency * out.count(t)
            out.append(int(logits.argmax()))
            if out[-1] in runner.eos:
                break
    return str(runner.tokenizer.decode(out, skip_special_tokens=True))


def test_repetition_penalty_gives_generate_s_tokens_beside_plain_requests(
    runner: TextGenerationRunner,
) -> None:
    wanted = [generate(runner, p, 16, repetition_penalty=3.0) for p in PROMPTS[:3]]
    assert wanted != [greedy(runner, p, 16) for p in PROMPTS[:3]]  # the rule changes them
    preps = prepare(runner, *(req(f"r{i}", inputs=[p], max_new_tokens=16, repetition_penalty=3.0)
                              for i, p in enumerate(PROMPTS[:3])),
                    req("plain", inputs=[PROMPTS[3]], max_new_tokens=16))  # fmt: skip
    d = Driver(runner)
    d.step([("r0", preps[0]), ("plain", preps[3])])
    d.step([("r1", preps[1])])  # joins while the others decode
    d.step()
    d.step([("r2", preps[2])])
    d.run()
    assert [d.finals[f"r{i}"].outputs[0]["text"] for i in range(3)] == wanted
    assert d.finals["plain"].outputs[0]["text"] == greedy(runner, PROMPTS[3], 16)


def test_presence_and_frequency_penalties_follow_the_reference(
    runner: TextGenerationRunner,
) -> None:
    cases = [(0.0, 0.2), (0.6, 0.0), (0.1, 0.1)]  # (presence, frequency)
    wanted = [penalised(runner, PROMPTS[0], 16, p, f) for p, f in cases]
    assert len({*wanted, greedy(runner, PROMPTS[0], 16)}) == 4  # each rule changes the text
    preps = prepare(runner, *(req(f"c{i}", max_new_tokens=16, presence_penalty=p,
                                  frequency_penalty=f) for i, (p, f) in enumerate(cases)))  # fmt: skip
    d = Driver(runner)
    d.step([(f"c{i}", p) for i, p in enumerate(preps)])
    d.run()
    assert [d.finals[f"c{i}"].outputs[0]["text"] for i in range(3)] == wanted


@pytest.fixture(scope="module")
def eos_early(lm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The model with its first greedy token for PROMPTS[0] made an end-of-sequence token,
    so plain greedy stops there; and that token."""
    probe = TextGenerationRunner(lm_dir, device=DEVICE, dtype="float32", options=OPTIONS)
    ids = probe.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    first = int(probe.model(ids).logits[0, -1].argmax())
    path = tmp_path_factory.mktemp("eos") / "lm"
    shutil.copytree(lm_dir, path)
    cfg = json.loads((path / "generation_config.json").read_text())
    cfg["eos_token_id"] = [first, cfg["eos_token_id"]]
    (path / "generation_config.json").write_text(json.dumps(cfg))
    return path, first


@pytest.fixture(params=["padded", "paged"])
def eos_runner(
    eos_early: tuple[Path, int], request: pytest.FixtureRequest
) -> tuple[TextGenerationRunner, int]:
    """A runner (each engine) of :func:`eos_early`'s model, and its early end token."""
    path, eos = eos_early
    runner = TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                  options={**OPTIONS, "engine": request.param})  # fmt: skip
    assert eos in runner.eos
    return runner, eos


def test_an_end_of_sequence_token_leaves_no_stop_reason(
    eos_runner: tuple[TextGenerationRunner, int],
) -> None:
    # vLLM's: an end-of-sequence token ends an output with no stop_reason, listed in
    # stop_token_ids or not; a stop string or another stop token does set it
    runner, eos = eos_runner
    made = runner.tokenizer.decode([eos], skip_special_tokens=True)
    outs = run(runner, req("eos", max_new_tokens=6), req("listed", max_new_tokens=6,
               stop_token_ids=[eos, 5]), req("len", max_new_tokens=1, ignore_eos=True),
               req("other", max_new_tokens=1, ignore_eos=True, stop_token_ids=[eos]))  # fmt: skip
    for key in ("eos", "listed"):
        (out,) = outs[key]
        assert (out["finish_reason"], out["completion_tokens"]) == ("stop", 1), key
        assert "stop_reason" not in out, key
    (length,) = outs["len"]
    assert length["finish_reason"] == "length" and "stop_reason" not in length
    # ignore_eos: the same token, a stop token like any other
    (other,) = outs["other"]
    assert (other["finish_reason"], other["stop_reason"], other["text"]) == ("stop", eos, made)


def test_min_new_tokens_holds_back_the_end_of_sequence(
    eos_runner: tuple[TextGenerationRunner, int],
) -> None:
    runner, _ = eos_runner
    preps = prepare(runner, req("plain", max_new_tokens=12),
                    req("held", max_new_tokens=12, min_new_tokens=7))  # fmt: skip
    d = Driver(runner)
    d.step([("plain", preps[0]), ("held", preps[1])])
    d.run()
    plain, held = d.finals["plain"].outputs[0], d.finals["held"].outputs[0]
    assert (plain["finish_reason"], plain["completion_tokens"]) == ("stop", 1)
    assert held["completion_tokens"] >= 7
    assert held["text"] == generate(runner, PROMPTS[0], 12, min_new_tokens=7)


def test_a_sampled_request_with_penalties_is_seeded_across_batch_mates_and_preemption(
    runner: TextGenerationRunner,
) -> None:
    rules = {"temperature": 1.2, "seed": 5, "repetition_penalty": 1.3, "frequency_penalty": 0.5}

    def run(preempt_at: int | None, mates: int) -> str:
        preps = prepare(runner, req("s", max_new_tokens=14, **rules),
                        *(req(f"m{i}", inputs=[PROMPTS[i]], max_new_tokens=9,
                              repetition_penalty=1.2) for i in range(mates)))  # fmt: skip
        d = Driver(runner)
        d.step([(f"m{i}", preps[1 + i]) for i in range(mates)])
        d.step([("s", preps[0])])
        for i in range(4):
            d.step(preempt=["s"] if i == preempt_at else ())
        if preempt_at is not None:
            d.step([("s", preps[0])])
        d.run()
        return str(d.finals["s"].outputs[0]["text"])

    alone = run(None, 0)
    assert run(None, 3) == alone
    assert run(2, 2) == alone


def test_a_sampled_request_read_again_after_a_restart_draws_its_first_life_s_text(
    runner: TextGenerationRunner,
) -> None:
    def fresh() -> tuple[Driver, object]:
        (p,) = prepare(runner, req("a", max_new_tokens=12, temperature=1.4, seed=9,
                                   presence_penalty=0.8))  # fmt: skip
        return Driver(runner), p

    d, p = fresh()
    d.step([("a", p)])  # type: ignore[list-item]
    d.run()
    whole = d.finals["a"].outputs[0]["text"]
    d, p = fresh()
    d.step([("a", p)])  # type: ignore[list-item]
    d.step()
    d.step()
    runner.forget_all()  # the loop crashed; it reads "a" again under the same key
    d, p = fresh()
    d.step([("a", p)])  # type: ignore[list-item]
    d.run()
    assert d.finals["a"].outputs[0]["text"] == whole


def test_min_new_tokens_over_the_request_s_maximum_is_refused(
    runner: TextGenerationRunner,
) -> None:
    # over an explicit max_new_tokens: the request is invalid before any runner
    with pytest.raises(ValueError, match="min_new_tokens 9 > max_new_tokens 8"):
        req("a", max_new_tokens=8, min_new_tokens=9)
    # over the model's default max_new_tokens (256): refused when prepared
    (out,) = runner.prepare_many([req("b", min_new_tokens=300)])
    assert isinstance(out, PrepareError) and out.code == ErrorCode.INVALID_REQUEST
    assert "min_new_tokens 300 > max_new_tokens 256" in str(out)


def test_the_sampler_leaves_plain_greedy_sequences_alone() -> None:
    sampler = SeededSampler([2])
    sampler.add("plain", Sampling(), [5, 6])
    logits = torch.tensor([0.0, 1.0, 3.0, -1.0])
    assert sampler.draw("plain", logits) is None  # the engine's own argmax
    sampler.add("held", Sampling(min_new_tokens=1, repetition_penalty=2.0), [1, 3])
    # eos (2) masked for the first token; 1 (seen, positive) halved, 3 (seen, negative) doubled
    assert sampler.draw("held", logits) == 1 and sampler.draw("held", logits) == 2
    assert logits.tolist() == [0.0, 1.0, 3.0, -1.0]  # the caller's row is not changed


def reference_logprobs(runner: TextGenerationRunner, text: str, tokens: list[int]) -> torch.Tensor:
    """The model's log-probabilities at each generated position (one full forward)."""
    prompt = runner.tokenizer(text).input_ids
    with torch.inference_mode():
        x = torch.tensor([prompt + tokens], device=runner.torch_device)
        logits = runner.model(x).logits[0, len(prompt) - 1 : -1].float().cpu()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_are_the_model_s_own_beside_plain_requests(runner: TextGenerationRunner) -> None:
    preps = prepare(runner, req("lp", max_new_tokens=10, logprobs=3),
                    req("plain", inputs=[PROMPTS[2]], max_new_tokens=10),
                    req("zero", inputs=[PROMPTS[1]], max_new_tokens=6, logprobs=0))  # fmt: skip
    d = Driver(runner)
    d.step([("plain", preps[1]), ("lp", preps[0])])
    d.step([("zero", preps[2])])
    d.run()
    out = d.finals["lp"].outputs[0]
    assert out["text"] == greedy(runner, PROMPTS[0], 10)
    assert "logprobs" not in d.finals["plain"].outputs[0]
    kept = out["logprobs"]
    tokens = [e["token"] for e in kept]
    assert len(kept) == out["completion_tokens"] == 10
    assert runner.tokenizer.decode(tokens) == out["text"]
    ref = reference_logprobs(runner, PROMPTS[0], tokens)
    for k, e in enumerate(kept):
        assert e["logprob"] == pytest.approx(float(ref[k, e["token"]]), abs=1e-4)
        assert [t["token"] for t in e["top"]] == ref[k].topk(3).indices.tolist()
        assert [t["logprob"] for t in e["top"]] == pytest.approx(ref[k].topk(3).values.tolist(),
                                                                 abs=1e-4)  # fmt: skip
        assert e["top"][0]["token"] == e["token"]  # greedy: the likeliest
        assert e["text"] == runner.tokenizer.decode([e["token"]])
    zero = d.finals["zero"].outputs[0]["logprobs"]
    assert len(zero) == 6 and all(e["top"] == [] for e in zero)


def test_logprobs_come_before_the_rules_and_survive_a_preemption(
    runner: TextGenerationRunner,
) -> None:
    rules = {"temperature": 1.1, "seed": 3, "repetition_penalty": 2.0, "logprobs": 2}

    def run(preempt_at: int | None) -> dict[str, Any]:
        (p,) = prepare(runner, req("s", max_new_tokens=12, **rules))
        d = Driver(runner)
        d.step([("s", p)])
        for i in range(4):
            d.step(preempt=["s"] if i == preempt_at else ())
        if preempt_at is not None:
            d.step([("s", p)])
        d.run()
        return d.finals["s"].outputs[0]

    whole, resumed = run(None), run(1)
    assert resumed["text"] == whole["text"]
    tokens = [e["token"] for e in whole["logprobs"]]
    assert [e["token"] for e in resumed["logprobs"]] == tokens and len(tokens) == 12
    ref = reference_logprobs(runner, PROMPTS[0], tokens)
    for k, (a, b) in enumerate(zip(whole["logprobs"], resumed["logprobs"], strict=True)):
        assert a["logprob"] == pytest.approx(float(ref[k, tokens[k]]), abs=1e-4)
        assert b["logprob"] == pytest.approx(a["logprob"], abs=1e-4)


def test_streamed_deltas_carry_their_tokens_logprobs(runner: TextGenerationRunner) -> None:
    preps = prepare(runner, req("st", inputs=PROMPTS[:2], max_new_tokens=9, stream=True,
                                logprobs=1),
                    req("plain", max_new_tokens=9, stream=True))  # fmt: skip
    d = Driver(runner)
    d.step([("st", preps[0]), ("plain", preps[1])])
    d.run()
    for i, out in enumerate(d.finals["st"].outputs):
        chunks = [c for c in d.partials["st"] if c["input"] == i]
        assert all(len(c["logprobs"]) == c["tokens"] for c in chunks)
        streamed = [e for c in chunks for e in c["logprobs"]]
        assert streamed == out["logprobs"] and len(streamed) == out["completion_tokens"] == 9
        assert "".join(c["text"] for c in chunks) == out["text"]
    assert all("logprobs" not in c for c in d.partials["plain"])


def test_the_last_delta_carries_tokens_that_add_no_text(
    eos_runner: tuple[TextGenerationRunner, int],
) -> None:
    # the model's first greedy token ends the sequence (made an end-of-sequence token); as a
    # stop string it adds no text, yet it is a token with its log-probability
    runner, eos = eos_runner
    first = runner.tokenizer.decode([eos])
    preps = prepare(runner, req("e", max_new_tokens=12, stream=True, logprobs=2, stop=[first]),
                    req("m", max_new_tokens=12, min_new_tokens=5, stream=True, logprobs=0))  # fmt: skip
    d = Driver(runner)
    d.step([("e", preps[0]), ("m", preps[1])])
    d.run()
    out = d.finals["e"].outputs[0]
    assert (out["text"], out["completion_tokens"], out["finish_reason"]) == ("", 1, "stop")
    assert d.partials["e"] == [{"input": 0, "text": "", "tokens": 1, "logprobs": out["logprobs"],
                                "prompt_tokens": out["prompt_tokens"]}]  # fmt: skip
    assert out["logprobs"][0]["token"] == eos
    # a longer text: the deltas add up to the result too
    mid = d.finals["m"].outputs[0]
    assert mid["completion_tokens"] >= 5
    assert sum(c["tokens"] for c in d.partials["m"]) == mid["completion_tokens"]
    assert [e for c in d.partials["m"] for e in c["logprobs"]] == mid["logprobs"]
    assert "".join(c["text"] for c in d.partials["m"]) == mid["text"]


def test_stop_token_ids_end_the_text_after_the_token(runner: TextGenerationRunner) -> None:
    ids = runner.tokenizer(PROMPTS[0], return_tensors="pt").input_ids.to(runner.torch_device)
    made = runner.model.generate(ids, max_new_tokens=16, do_sample=False, repetition_penalty=3.0,
                                 pad_token_id=runner.eos[0])[0, ids.shape[1] :].tolist()  # fmt: skip
    at = next(k for k in range(3, 16) if made[k] not in made[:k])  # its first time
    preps = prepare(runner, req("st", max_new_tokens=16, repetition_penalty=3.0, stream=True,
                                stop_token_ids=[made[at], 399]),
                    req("plain", max_new_tokens=16, repetition_penalty=3.0))  # fmt: skip
    d = Driver(runner)
    d.step([("st", preps[0]), ("plain", preps[1])])
    d.run()
    out = d.finals["st"].outputs[0]
    assert (out["finish_reason"], out["completion_tokens"]) == ("stop", at + 1)
    assert out["stop_reason"] == made[at]  # vLLM's: the stop token that ended it
    assert out["text"] == runner.tokenizer.decode(made[: at + 1], skip_special_tokens=True)
    assert "".join(c["text"] for c in d.partials["st"]) == out["text"]
    plain = d.finals["plain"].outputs[0]
    assert plain["completion_tokens"] == 16  # its batch-mate goes on
    assert plain["finish_reason"] == "length" and "stop_reason" not in plain
    (bad,) = runner.prepare_many([req("b", stop_token_ids=[runner.vocab_size])])
    assert isinstance(bad, PrepareError) and "not tokens of this model" in str(bad)


def test_logit_bias_gives_generate_s_tokens_with_its_sequence_bias(
    runner: TextGenerationRunner,
) -> None:
    ids = runner.tokenizer(PROMPTS[0], return_tensors="pt").input_ids.to(runner.torch_device)

    def generate_biased(bias: dict[int, float]) -> list[int]:
        seq_bias = {(t,): b for t, b in bias.items()} or None
        out = runner.model.generate(ids, max_new_tokens=10, do_sample=False,
                                    pad_token_id=runner.eos[0], sequence_bias=seq_bias)  # fmt: skip
        return [int(t) for t in out[0, ids.shape[1] :]]

    plain = generate_biased({})
    bias = {plain[0]: -100.0, plain[0] + 1: 3.0}  # ban the first token, favour another
    want = generate_biased(bias)
    assert want != plain and plain[0] not in want
    forced = 17
    preps = prepare(runner, req("b", max_new_tokens=10, logit_bias=bias, logprobs=0),
                    req("plain", max_new_tokens=10),
                    req("f", max_new_tokens=5, temperature=1.3, seed=2, logprobs=0,
                        logit_bias={forced: 100.0}))  # fmt: skip
    d = Driver(runner)
    d.step([("b", preps[0]), ("plain", preps[1]), ("f", preps[2])])
    d.run()
    assert [e["token"] for e in d.finals["b"].outputs[0]["logprobs"]] == want
    assert d.finals["plain"].outputs[0]["text"] == runner.tokenizer.decode(
        plain, skip_special_tokens=True
    )
    # sampled: a token given +100 is all but certain, every time
    assert [e["token"] for e in d.finals["f"].outputs[0]["logprobs"]] == [forced] * 5
    (bad,) = runner.prepare_many([req("x", logit_bias={runner.vocab_size: 1.0})])
    assert isinstance(bad, PrepareError) and "logit_bias" in str(bad)


def test_min_p_draws_only_tokens_near_the_likeliest() -> None:
    from batchfleet.worker.generation.sampling import sample

    # probabilities 0.5, 0.3 (0.6 of the likeliest), 0.2 (0.4 of it), at temperature 1
    logits = torch.tensor([0.5, 0.3, 0.2]).log()

    def draws(min_p: float) -> set[int]:
        gen = torch.Generator().manual_seed(1)
        return {sample(logits, Sampling(1.0, min_p=min_p), gen) for _ in range(300)}

    assert draws(0.0) == {0, 1, 2}
    assert draws(0.5) == {0, 1}  # 0.2 < 0.5 * 0.5
    assert draws(0.7) == {0}
    assert draws(1.0) == {0}  # the likeliest always stays


def test_min_p_through_the_runner_keeps_every_token_near_the_likeliest(
    runner: TextGenerationRunner,
) -> None:
    # Given sampled requests (a random model's logits are flat: most tokens are drawn),
    # one with min_p 0.5 and one without, beside a plain greedy one
    preps = prepare(runner, req("m", max_new_tokens=24, temperature=1.0, seed=3, min_p=0.5,
                                logprobs=1, ignore_eos=True),
                    req("any", max_new_tokens=24, temperature=1.0, seed=3, logprobs=1,
                        ignore_eos=True),
                    req("plain", max_new_tokens=8))  # fmt: skip
    d = Driver(runner)
    d.step([("m", preps[0]), ("any", preps[1]), ("plain", preps[2])])
    d.run()

    def ratios(rid: str) -> list[float]:
        """Each drawn token's probability over the likeliest's, after temperature."""
        lps = d.finals[rid].outputs[0]["logprobs"]
        return [float(torch.tensor(e["logprob"] - e["top"][0]["logprob"]).exp()) for e in lps]

    # Then every token of the min_p request is at least half as likely as the likeliest,
    # while the other draws some that are not
    assert len(ratios("m")) == 24 and min(ratios("m")) >= 0.5 - 1e-4
    assert min(ratios("any")) < 0.5
    assert d.finals["plain"].outputs[0]["text"] == greedy(runner, PROMPTS[0], 8)


def test_ignore_eos_generates_past_the_end_of_sequence(
    eos_runner: tuple[TextGenerationRunner, int],
) -> None:
    # the model's first greedy token ends the sequence; ignored, generation goes on to
    # max_new_tokens with the tokens a plain greedy loop makes (the end token among them)
    runner, eos = eos_runner
    ids = runner.tokenizer(PROMPTS[0]).input_ids
    made: list[int] = []
    with torch.inference_mode():
        for _ in range(9):
            x = torch.tensor([ids + made], device=runner.torch_device)
            made.append(int(runner.model(x).logits[0, -1].argmax()))
    assert made[0] == eos
    preps = prepare(runner, req("i", max_new_tokens=9, ignore_eos=True, logprobs=0, stream=True),
                    req("plain", max_new_tokens=9))  # fmt: skip
    d = Driver(runner)
    d.step([("i", preps[0]), ("plain", preps[1])])
    d.run()
    out = d.finals["i"].outputs[0]
    assert (out["finish_reason"], out["completion_tokens"]) == ("length", 9)
    assert [e["token"] for e in out["logprobs"]] == made
    assert out["text"] == runner.tokenizer.decode(made, skip_special_tokens=True)
    plain = d.finals["plain"].outputs[0]
    assert (plain["finish_reason"], plain["completion_tokens"]) == ("stop", 1)


def test_prompt_logprobs_with_max_new_tokens_0_are_those_of_max_1(
    runner: TextGenerationRunner,
) -> None:
    # Given: a prompt's score (lm-eval's loglikelihood: echo, logprobs, max_tokens 0) for
    # two inputs and two completions each, streamed, beside the same with max 1
    texts = ["the man was", "a b c"]
    zero = req("z", inputs=texts, max_new_tokens=0, n=2, prompt_logprobs=2, stream=True,
               return_token_ids=True, logprobs=1)  # fmt: skip
    lengths = [len(runner.tokenizer(t).input_ids) for t in texts]
    preps = prepare(runner, zero, req("one", inputs=texts, max_new_tokens=1, prompt_logprobs=2),
                    req("plain", max_new_tokens=4))  # fmt: skip
    # only each input's scored first completion takes the KV cache (its prompt)
    assert preps[0].prompts == (lengths[0], 0, lengths[1], 0)
    # When: they run
    d = Driver(runner)
    d.step([("z", preps[0]), ("one", preps[1]), ("plain", preps[2])])
    d.run()
    # Then: the same scores, and no token: the one its prefill took is dropped
    outs, ones = d.finals["z"].outputs, d.finals["one"].outputs
    for i, one in enumerate(ones):
        first, second = outs[2 * i], outs[2 * i + 1]
        assert first["prompt_logprobs"] == one["prompt_logprobs"]
        assert len(first["prompt_logprobs"]) == first["prompt_tokens"] == lengths[i]
        assert "prompt_logprobs" not in second
        for out in (first, second):
            assert out["text"] == "" and out["completion_tokens"] == 0
            assert out["finish_reason"] == "length"
            assert out["token_ids"] == out["logprobs"] == []
        assert one["completion_tokens"] == 1
    assert "z" not in d.partials and all("z" not in rep.produced for rep in d.reports)
    assert d.finals["plain"].outputs[0]["text"] == greedy(runner, PROMPTS[0], 4)
    assert not runner._reqs and not runner._by_seq


def test_prompt_logprobs_score_each_prompt_in_its_first_output(
    runner: TextGenerationRunner,
) -> None:
    want = req("p", inputs=["the man was", "a b c"], max_new_tokens=2, n=2, prompt_logprobs=2,
               temperature=0.8, seed=1)  # fmt: skip
    preps = prepare(runner, want, req("plain", max_new_tokens=4))
    d = Driver(runner)
    d.step([("p", preps[0]), ("plain", preps[1])])
    d.run()
    outs = d.finals["p"].outputs
    for i, text in enumerate(["the man was", "a b c"]):
        ids = runner.tokenizer(text).input_ids
        first, second = outs[2 * i], outs[2 * i + 1]
        assert "prompt_logprobs" not in second  # only the input's first completion
        scored = first["prompt_logprobs"]
        assert scored[0] is None and len(scored) == first["prompt_tokens"] == len(ids)
        with torch.inference_mode():
            x = torch.tensor([ids], device=runner.torch_device)
            lp = torch.log_softmax(runner.model(x).logits[0].float().cpu(), dim=-1)
        assert [e["token"] for e in scored[1:]] == ids[1:]
        assert [e["logprob"] for e in scored[1:]] == pytest.approx(
            [float(lp[k, t]) for k, t in enumerate(ids[1:])], abs=1e-4
        )
        assert all(len(e["top"]) == 2 and e["text"] for e in scored[1:])
    assert d.finals["plain"].outputs[0]["text"] == greedy(runner, PROMPTS[0], 4)


def test_allowed_token_ids_give_generate_s_tokens_restricted_to_them(
    runner: TextGenerationRunner,
) -> None:
    tok = runner.tokenizer
    free = hf_tokens(runner, PROMPTS[1], 12)
    allowed = sorted(
        {*tok(" the man was a dog", add_special_tokens=False).input_ids, runner.eos[0]}
    )
    assert not set(free) <= set(allowed)  # the restriction changes the text
    made = hf_tokens(runner, PROMPTS[1], 12, prefix_allowed_tokens_fn=lambda b, x: allowed)
    wanted = [t for t in made if t != runner.eos[0]]
    preps = prepare(runner, req("only", inputs=[PROMPTS[1]], max_new_tokens=12, logprobs=0,
                                allowed_token_ids=list(reversed(allowed)) + allowed[:2]),
                    req("drawn", inputs=[PROMPTS[1]], max_new_tokens=12, logprobs=0, seed=3,
                        temperature=1.5, allowed_token_ids=allowed),
                    req("plain", inputs=[PROMPTS[1]], max_new_tokens=12))  # fmt: skip
    d = Driver(runner)
    d.step([(k, p) for k, p in zip(("only", "drawn", "plain"), preps, strict=True)])
    d.run()
    only = d.finals["only"].outputs[0]
    assert [lp["token"] for lp in only["logprobs"] if lp["token"] != runner.eos[0]] == wanted
    assert only["text"] == tok.decode(wanted)
    drawn = d.finals["drawn"].outputs[0]
    assert {lp["token"] for lp in drawn["logprobs"]} <= set(allowed)
    assert d.finals["plain"].outputs[0]["text"] == tok.decode(free, skip_special_tokens=True)
    (bad,) = runner.prepare_many([req("b", allowed_token_ids=[1, runner.vocab_size])])
    assert isinstance(bad, PrepareError) and "allowed_token_ids" in str(bad)


def test_skip_special_tokens_false_keeps_special_tokens_text(
    runner: TextGenerationRunner,
) -> None:
    start = runner.tokenizer.convert_tokens_to_ids("<|im_start|>")
    eos = runner.eos[0]
    pushed = {"allowed_token_ids": [start, eos], "logit_bias": {str(start): 100.0},
              "max_new_tokens": 3, "stream": True}  # fmt: skip
    ended = {"allowed_token_ids": [eos], "max_new_tokens": 3}
    outs = run(runner, req("kept", skip_special_tokens=False, **pushed), req("skipped", **pushed),
               req("eos", skip_special_tokens=False, **ended))  # fmt: skip
    assert outs["kept"][0]["text"] == "<|im_start|>" * 3
    assert outs["skipped"][0]["text"] == ""  # the default
    assert set(req("r", **pushed).generation_fields()) >= {"allowed_token_ids"}  # not to encoders
    assert req("s", skip_special_tokens=False).generation_fields() == ["skip_special_tokens"]
    eos_out = outs["eos"][0]  # the end-of-sequence token shows no text
    assert (eos_out["text"], eos_out["finish_reason"], eos_out["completion_tokens"]) == (
        "",
        "stop",
        1,
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"allowed_token_ids": []}, "at least 1"),
        ({"allowed_token_ids": [-1]}, "0 to 2**31"),
        ({"allowed_token_ids": list(range(8_193))}, "at most 8192"),
    ],
)
def test_allowed_token_ids_bounds(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        req("x", **fields)


def test_bad_words_give_generate_s_tokens_with_its_bad_words_ids(
    runner: TextGenerationRunner,
) -> None:
    tok = runner.tokenizer
    free = hf_tokens(runner, PROMPTS[0], 16)
    # a word the free text writes as two tokens, and one it writes as one
    pair = next(free[k : k + 2] for k in range(len(free) - 1)
                if len(tok(tok.decode(free[k : k + 2]), add_special_tokens=False).input_ids) == 2)  # fmt: skip
    words = [tok.decode(pair).strip(), tok.decode(free[:1]).strip()]
    (prep,) = prepare(runner, req("bw", max_new_tokens=16, bad_words=words, logprobs=0))
    banned = [list(w) for w in prep.payload.sampling.bad_words]
    assert banned and all(w for w in banned)
    made = hf_tokens(runner, PROMPTS[0], 16, bad_words_ids=banned)
    assert made != free  # the words change the text
    d = Driver(runner)
    d.step([("bw", prep)])
    d.run()
    out = d.finals["bw"].outputs[0]
    got = [lp["token"] for lp in out["logprobs"]]
    assert got == made[: len(got)] and (len(got) == 16 or got[-1] in runner.eos)
    for w in banned:  # none completed
        assert all(got[k : k + len(w)] != w for k in range(len(got)))
    assert req("x", bad_words=["a"]).generation_fields() == ["bad_words"]
    for bad in ([], [""], ["x" * 257], ["w"] * 129):
        with pytest.raises(ValueError):
            req("x", bad_words=bad)


def test_logprob_ranks_are_the_vocabulary_ranks_of_the_model_s_logits(
    runner: TextGenerationRunner,
) -> None:
    # Given a prompt scored and tokens drawn, neither only the likeliest
    text = "the man was a b c"
    preps = prepare(runner, req("r", inputs=[text], max_new_tokens=6, prompt_logprobs=1,
                                logprobs=1, temperature=1.5, seed=3))  # fmt: skip
    d = Driver(runner)
    d.step([("r", preps[0])])
    d.run()
    out = d.finals["r"].outputs[0]
    ids = runner.tokenizer(text).input_ids
    drawn = [e["token"] for e in out["logprobs"]]
    with torch.inference_mode():
        x = torch.tensor([ids + drawn], device=runner.torch_device)
        lp = torch.log_softmax(runner.model(x).logits[0].float().cpu(), dim=-1)

    # Then each token's rank is 1 + the tokens strictly likelier (brute force, row by row)
    def rank(row: int, token: int) -> int:
        return 1 + sum(1 for v in lp[row].tolist() if v > float(lp[row, token]) + 1e-5)

    scored = out["prompt_logprobs"][1:]
    assert [e["rank"] for e in scored] == [rank(k, t) for k, t in enumerate(ids[1:])]
    assert [e["rank"] for e in out["logprobs"]] == [
        rank(len(ids) - 1 + k, t) for k, t in enumerate(drawn)
    ]
    assert any(e["rank"] > 1 for e in scored) and any(e["rank"] > 1 for e in out["logprobs"])
