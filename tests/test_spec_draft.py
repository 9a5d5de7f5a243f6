"""Draft-model speculative decoding (vLLM's ``method = "draft_model"``) in the padded
engine: greedy tokens exactly those without speculation, sequences arriving at different
steps with prompts of different lengths (prefilled into the draft's cache in chunks),
through the lean fused step and transformers' forwards; a draft model identical to the
target has every draft accepted (its cache stays lined up with each row's context); the
option, the vocabulary check and the paged engine's refusal; a cancelled row's draft cache
goes; the runner's answers and ``info()``; a draft of a family the lean forward does not
run (Qwen3) through transformers' forwards; LoRA rows verifying a base draft's drafts under
their adapter."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchfleet.worker.generation.draft import DraftProposer, common, load  # noqa: E402
from batchfleet.worker.generation.padded import PaddedEngine  # noqa: E402
from batchfleet.worker.generation.sampling import Sampling  # noqa: E402
from batchfleet.worker.generation.speculative import DraftConfig, NgramConfig, parse  # noqa: E402
from devices import DEVICE  # noqa: E402
from test_padded_engine import EOS, _until_done, generate, run  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The target (2 layers), a draft (its first layer alone, as the same seed draws it,
    with its final norm's scales scrambled: it agrees with the target often, not always;
    a random model's greedy text mostly repeats itself, which any such draft predicts),
    and a model of another vocabulary."""
    root = tmp_path_factory.mktemp("spec-draft")
    small = make_causal_lm(root / "small", layers=1)
    model = _model(small, "cpu")  # the CPU's random draws, whatever the tests' device
    torch.manual_seed(0)
    with torch.no_grad():
        norm = model.model.norm.weight
        norm.copy_(1 + torch.randn_like(norm))
    model.save_pretrained(small)
    model.resize_token_embeddings(model.config.vocab_size + 8)
    model.save_pretrained(root / "other")
    return {"target": make_causal_lm(root / "target"), "small": small, "other": root / "other"}


def _model(path: Path, device: str = DEVICE) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)


@pytest.fixture(scope="module")
def target(dirs: dict[str, Path]) -> Any:
    return _model(dirs["target"])


def _proposer(path: Path, k: int = 4, chunk: int = 8, **kw: Any) -> DraftProposer:
    return DraftProposer(_model(path), DraftConfig(str(path), k), chunk=chunk, **kw)


def _seqs(count: int, seed: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    return [(f"s{i}", [rng.randrange(3, 400) for _ in range(rng.randint(2, 45))],
             rng.randint(1, 30)) for i in range(count)]  # fmt: skip


def _engine(model: Any, spec: Any, lean: bool, eos: list[int]) -> PaddedEngine:
    return PaddedEngine(model, eos_token_ids=eos, step_tokens=40, max_running=5, lean=lean,
                        speculative=spec)  # fmt: skip


def _run(engine: PaddedEngine, seqs: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    """Step until all finished, the sequences arriving three steps apart."""
    return run(engine, {3 * i: [s] for i, s in enumerate(seqs)})


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_greedy_tokens_are_exactly_those_without_speculation(
    lean: bool, target: Any, dirs: dict[str, Path]
) -> None:
    seqs = _seqs(12, seed=3)
    plain = _run(_engine(target, None, lean, [EOS]), seqs)
    draft = _proposer(dirs["small"])
    engine = _engine(target, draft, lean, [EOS])
    got = _run(engine, seqs)
    assert got == plain
    for name, prompt, n in seqs[:4]:
        assert got[name] == generate(target, prompt, n), name
    rows, drafts = engine.drafted
    assert rows and 0 < sum(engine.accepted) < drafts  # accepted and rejected drafts
    assert draft.tokens == 0 and not engine._rows  # every row's draft cache went with it


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_a_draft_identical_to_the_target_has_every_draft_accepted(
    lean: bool, target: Any, dirs: dict[str, Path]
) -> None:
    # Given: the target's own weights as the draft, prompts up to 45 tokens going into
    # its cache 8 a step, no end-of-sequence (every row runs to max_new_tokens)
    seqs = _seqs(10, seed=5)
    draft = _proposer(dirs["target"], k=3, chunk=8)
    engine = _engine(target, draft, lean, [])
    # When: they run, arriving at different steps
    got = _run(engine, seqs)
    # Then: every draft is the target's own pick, so every one is accepted: the draft's
    # cache holds exactly each row's context whatever was accepted before
    assert got == _run(_engine(target, None, lean, []), seqs)
    rows, drafts = engine.drafted
    assert rows > 20 and sum(engine.accepted) == drafts
    assert engine.accepted[0] == rows  # (every row that proposed had its first accepted)


def _greedy(model: Any, context: list[int], n: int) -> list[int]:
    """``n`` argmax tokens after ``context``, each from a forward over all before it."""
    tokens = list(context)
    for _ in range(n):
        tokens.append(
            int(model(input_ids=torch.tensor([tokens], device=model.device)).logits[0, -1].argmax())
        )
    return tokens[len(context) :]


class _Watch:
    """A draft proposer's proposals, forwards (the tokens each row held after one, and
    its logits) and the context tokens each call ran, kept as it runs."""

    def __init__(self, draft: DraftProposer, prompt: int = 0) -> None:
        self.draft, self.prompt = draft, prompt
        self.proposed: list[tuple[list[int], list[int]]] = []
        self.forwards: list[tuple[list[int], Any]] = []
        self.pieces: list[int] = []
        self.ran = 0
        """Tokens run at positions before ``prompt``."""
        self._calls = draft.propose, draft._forward, draft._first
        draft.propose, draft._forward, draft._first = self.propose, self.forward, self.first  # type: ignore[method-assign]

    def propose(self, rows: Any, budget: int) -> list[list[int]]:
        out = self._calls[0](rows, budget)
        self.proposed.extend((list(c), d) for (_, c, _), d in zip(rows, out, strict=True) if d)
        return out

    def forward(self, feed: dict[int, int], chunks: dict[int, list[int]]) -> Any:
        logits = self._calls[1](feed, chunks)
        held, rows = self.draft._held, logits.shape[0] - len(chunks)
        self.forwards.extend((list(held[row]), logits[row].clone()) for row in feed)
        self.forwards.extend((list(held[row]), logits[rows + i].clone())
                             for i, row in enumerate(chunks))  # fmt: skip
        return logits

    def first(self, pieces: dict[int, list[int]], asking: list[int]) -> list[int]:
        for row, piece in pieces.items():
            held = len(self.draft._held[row])
            self.pieces.append(len(piece))
            self.ran += max(0, min(held + len(piece), self.prompt) - held)
        return self._calls[2](pieces, asking)  # type: ignore[no-any-return]

    def check(self) -> None:
        """Every proposal is what the draft model alone says after that context, from
        scratch, and so is every forward's last logits: its cache held exactly the tokens
        it ran after."""
        model = self.draft.model
        with torch.inference_mode():
            for tokens, logits in self.forwards:
                alone = model(input_ids=torch.tensor([tokens], device=model.device)).logits[0, -1]
                torch.testing.assert_close(logits, alone, atol=1e-4, rtol=1e-4)
            for context, drafts in self.proposed:
                assert drafts == _greedy(model, context, len(drafts)), context


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_each_proposal_is_the_draft_s_greedy_text_after_rejections_too(
    lean: bool, target: Any, dirs: dict[str, Path]
) -> None:
    # Given: a draft the target often overrules, each of its proposals and forwards kept
    draft = _proposer(dirs["small"], k=4, chunk=8, lean=lean)
    assert (draft.lean is not None) == lean
    watch = _Watch(draft)
    engine = _engine(target, draft, True, [EOS])
    # When: sequences run with it
    _run(engine, _seqs(6, seed=7))
    # Then: every proposal and forward is the draft's own from scratch, whatever the
    # target rejected
    assert sum(engine.accepted) < engine.drafted[1]
    assert len(watch.proposed) > 20 and len(watch.forwards) > 60
    assert max(watch.pieces) == 8  # prompts go in 8 tokens a step at most
    watch.check()


@pytest.mark.parametrize("row_attention", [True, False], ids=["row-kernel", "sdpa"])
def test_the_lean_forward_proposes_what_transformers_forwards_propose(
    row_attention: bool, dirs: dict[str, Path]
) -> None:
    # Given: the draft through its lean forward and through transformers' forwards, rows
    # of prompts from 2 to 40 tokens (in 8-token chunks) arriving at different calls; after
    # each proposal a row keeps a random number of its drafts and one token of its own
    # (its cache is cut back past the rest), and rows leave
    lean = _proposer(dirs["small"], k=4, chunk=8, row_attention=row_attention)
    plain = _proposer(dirs["small"], k=4, chunk=8, lean=False)
    assert lean.lean is not None and plain.lean is None
    assert lean.row_attention == row_attention
    rng = random.Random(1)
    contexts: dict[str, list[int]] = {}
    made = cut = 0
    for call in range(40):
        if call % 4 == 0 and len(contexts) < 6:
            contexts[f"s{call}"] = [rng.randrange(3, 400) for _ in range(rng.randint(2, 40))]
        rows = [(name, c, rng.randint(1, 5)) for name, c in contexts.items()]
        # When: both propose for the same rows
        budget = rng.choice([6, 64])  # (6: the later rows draft fewer, or none)
        got = lean.propose(rows, budget)
        # Then: the same drafts
        assert got == plain.propose(rows, budget), call
        for (_, c, _), d in zip(rows, got, strict=True):
            kept = rng.randint(0, len(d))
            made += len(d) > 0
            cut += kept < len(d) - 1
            c += [*d[:kept], rng.randrange(3, 400)]
        if call % 7 == 6:
            gone = next(iter(contexts))
            del contexts[gone]
            lean.retain(contexts), plain.retain(contexts)
    assert made > 40 and cut > 20
    assert lean.prefilled == plain.prefilled and lean.tokens == plain.tokens


def test_n_completions_run_their_prompt_through_the_draft_once(
    target: Any, dirs: dict[str, Path]
) -> None:
    # Given: a request's 3 greedy completions of a 45-token prompt (the draft takes it 8
    # tokens a call), and the same prompt again while they run; the prompt's tokens each
    # forward of the draft runs are counted
    prompt = [random.Random(2).randrange(3, 400) for _ in range(45)]
    draft = _proposer(dirs["small"], k=3, chunk=8)
    watch = _Watch(draft, len(prompt))
    engine = _engine(target, draft, True, [EOS])
    # When: they run, the fourth added three steps after the first three
    got = run(engine, {0: [(n, prompt, 20) for n in "abc"], 3: [("d", prompt, 20)]})
    # Then: each is the greedy text of n = 1, and the prompt went into the draft's cache
    # once: the other rows took it from that row's cache (the twins as it went in, with
    # the greedy tokens they share), and propose from it what the draft alone says
    assert got == dict.fromkeys("abcd", generate(target, prompt, 20))
    assert watch.ran == len(prompt) and draft.shared > 3 * len(prompt)
    assert sum(engine.accepted) > 0 and len(watch.proposed) > 10
    watch.check()


def test_sampled_rows_with_a_draft_repeat_with_their_seed(
    target: Any, dirs: dict[str, Path]
) -> None:
    def sampled(seed: int) -> dict[str, list[int]]:
        engine = _engine(target, _proposer(dirs["small"]), True, [EOS])
        for name, prompt, n in _seqs(6, seed=9):
            engine.add(name, prompt, n, Sampling(temperature=0.5, seed=seed + int(name[1:])))
        out = _until_done(engine)
        assert sum(engine.accepted) > 0
        return out

    first = sampled(11)
    assert sampled(11) == first and sampled(12) != first


def test_a_cancelled_row_leaves_with_its_draft_cache(target: Any, dirs: dict[str, Path]) -> None:
    draft = _proposer(dirs["small"])
    engine = _engine(target, draft, True, [])
    engine.add("a", list(range(3, 20)), 40, Sampling())
    engine.add("b", list(range(30, 41)), 40, Sampling())
    while engine.drafted[0] < 4:  # both decode and speculate
        engine.step()
    assert draft._names == ["a", "b"]
    engine.cancel(["a"])
    engine.step()
    assert engine.running == 1 and [r.name for r in engine._rows] == ["b"]
    assert draft._names == ["b"]  # its cache went in the step it left; "b" took its row
    _until_done(engine)
    assert draft.tokens == 0 and not draft._names and not draft._layers


def test_the_draft_cache_is_no_longer_than_the_rows_context(
    target: Any, dirs: dict[str, Path]
) -> None:
    draft = _proposer(dirs["small"], k=6)
    engine = _engine(target, draft, True, [])
    engine.add("a", list(range(3, 30)), 12, Sampling())
    longest = 0
    while engine.running or engine._waiting:
        engine.step()
        longest = max(longest, draft.tokens)
    assert 27 < longest <= 27 + 12


# --- the proposer's cache, the option, loading ------------------------------------------


@pytest.mark.parametrize(
    "a,b,want",
    [([], [1], 0), ([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3], [1, 5, 3], 1),
     ([9, 2], [1, 2], 0), (list(range(50)), [*range(37), 0, *range(38, 60)], 37)],
)  # fmt: skip
def test_common_is_the_longest_common_prefix(a: list[int], b: list[int], want: int) -> None:
    assert common(a, b) == want


def test_a_sequence_whose_context_changed_drafts_from_the_new_one(dirs: dict[str, Path]) -> None:
    # the same name with another context (a preempted sequence added again, say): the
    # drafts are those of a fresh cache
    draft = _proposer(dirs["small"])
    draft.propose([("s", [5, 6, 7, 8, 9, 10], 4)], 64)
    (again,) = draft.propose([("s", [5, 6, 70, 80], 4)], 64)
    assert [again] == _proposer(dirs["small"]).propose([("t", [5, 6, 70, 80], 4)], 64)
    assert draft._held[0] == [5, 6, 70, 80, *again[:-1]]


@pytest.mark.parametrize(
    "raw,error",
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative\.model"),
        ({"method": "draft_model", "model": "/m"}, "num_speculative_tokens is required"),
        ({"model": "/m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
         "one device"),
        ({"model": "/m", "num_speculative_tokens": 65}, "num_speculative_tokens"),
        ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, "unknown keys"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ],
)  # fmt: skip
def test_the_option_is_checked(raw: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse(raw)


def test_a_model_names_the_draft_model_method() -> None:
    assert parse({"model": "/m", "num_speculative_tokens": 3}) == DraftConfig("/m", 3)
    assert parse({"num_speculative_tokens": 3}) == NgramConfig(3)


def test_a_draft_of_another_vocabulary_is_refused_at_load(
    target: Any, dirs: dict[str, Path]
) -> None:
    other = _model(dirs["other"]).config.vocab_size
    assert other != target.config.vocab_size
    with pytest.raises(
        ValueError, match=f"{other} tokens and the target's {target.config.vocab_size}"
    ):
        load(DraftConfig(str(dirs["other"]), 3), target, 64)
    loaded = load(DraftConfig(str(dirs["small"]), 3), target, 64)
    assert loaded.device == target.device and next(loaded.model.parameters()).dtype == torch.float32


# --- through the runner -------------------------------------------------------------------


def _runner(path: Path, **opts: Any) -> Any:
    from batchfleet.worker.runners.generation import TextGenerationRunner

    base = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 8}
    return TextGenerationRunner(path, device=DEVICE, dtype="float32", options={**base, **opts})


def test_the_runner_refuses_a_bad_draft_at_load(dirs: dict[str, Path]) -> None:
    spec = {"method": "draft_model", "model": str(dirs["other"]), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary"):
        _runner(dirs["target"], speculative=spec)
    missing = {**spec, "model": "/nonexistent"}  # the engine is refused before any load
    with pytest.raises(ValueError, match="padded engine"):
        _runner(dirs["target"], speculative=missing, engine="paged")


def test_the_runner_s_answers_are_those_without_speculation(dirs: dict[str, Path]) -> None:
    from batchfleet.schemas.messages import Request
    from test_speculative import _answers

    spec = {"method": "draft_model", "model": str(dirs["small"]), "num_speculative_tokens": 3}
    runners = [_runner(dirs["target"]), _runner(dirs["target"], speculative=spec)]

    def requests() -> list[Request]:
        return [
            Request(id="a", model="lm", inputs=["a b c a b c a b", "what is this"],
                    max_new_tokens=30, logprobs=1, return_token_ids=True),
            Request(id="n", model="lm", inputs=["it was the time"], max_new_tokens=20, n=2,
                    temperature=0.5, seed=4, logprobs=1),
        ]  # fmt: skip

    (plain, _, _), (got, reports, _) = (_answers(r, requests()) for r in runners)
    for a, b in zip(got["a"], plain["a"], strict=True):
        lps_a, lps_b = a.pop("logprobs"), b.pop("logprobs")
        assert a == b
        assert [x["token"] for x in lps_a] == [x["token"] for x in lps_b]
    assert [len(o["logprobs"]) for o in got["n"]] == [o["completion_tokens"] for o in got["n"]]
    assert sum(sum(r.accepted) for r in reports) > 0
    info = runners[1].info()
    assert info["speculative"] == {"method": "draft_model", "model": str(dirs["small"]),
                                   "num_speculative_tokens": 3}  # fmt: skip
    assert info["draft_kv_tokens"] == 0 and info["spec_decode_accepted_tokens"] > 0
    assert info["draft_prefill_tokens"] > 0 and info["draft_prefill_shared_tokens"] >= 0


def test_no_draft_goes_past_the_draft_model_s_context(dirs: dict[str, Path]) -> None:
    draft = _proposer(dirs["small"], chunk=64)
    draft.max_positions = 20
    rows = [("a", list(range(3, 21)), 10), ("b", list(range(30, 50)), 10),
            ("c", list(range(60, 81)), 10), ("d", [5, 6], 10)]  # fmt: skip
    # the last token of 18 runs at position 17, the drafts after it at 18 and 19: 3 drafts
    # (the third is read at 19); of 20, 1; of 21, none
    assert [len(d) for d in draft.propose(rows, 64)] == [3, 1, 0, 4]
    assert draft._names == ["a", "b", "d"]


# --- a draft the lean forward does not run, and LoRA rows ----------------------------------


@pytest.fixture(scope="module")
def qwen3(dirs: dict[str, Path]) -> Path:
    """A tiny random Qwen3 of the target's vocabulary: per-head q and k norms, a family
    the lean forward does not run, as a Qwen3-0.6B drafting for a Llama-vocabulary target
    would be. Its norms' scales are raised so its attention is peaked (a key read from the
    wrong column changes its picks)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = _model(dirs["target"], "cpu").config.vocab_size
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(4)
            layer.self_attn.k_norm.weight.mul_(4)
    path = dirs["small"].parent / "qwen3"
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_a_draft_the_lean_forward_refuses_drafts_through_transformers_forwards(
    lean: bool, target: Any, qwen3: Path
) -> None:
    from batchfleet.worker.generation.lean_decode import LeanDecoder

    # Given: the Qwen3 draft, loaded as the runner loads it, beside a target whose engine
    # runs the lean step (or transformers' forwards)
    draft = load(DraftConfig(str(qwen3), 3), target, 8)
    assert LeanDecoder.build(draft.model) is None and draft.lean is None
    assert not draft.row_attention
    watch = _Watch(draft)
    seqs = _seqs(8, seed=11)
    engine = _engine(target, draft, lean, [EOS])
    # When: sequences run with it, arriving at different steps
    got = _run(engine, seqs)
    # Then: the greedy tokens are those without speculation, and every proposal and
    # forward is the draft's own from scratch (its cache held each row's context)
    assert got == _run(_engine(target, None, lean, [EOS]), seqs)
    assert engine.drafted[1] > 30 and len(watch.proposed) > 10
    watch.check()
    assert draft.tokens == 0


def test_lora_rows_verify_a_base_draft_s_drafts_under_their_adapter(
    dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytest.importorskip("peft")
    from batchfleet.schemas.messages import Request
    from test_generation_lora import sql_and_chat
    from test_speculative import _answers

    # Given: two adapters of the target, and the target's own weights as the draft (no
    # adapter: vLLM applies LoRA to the target only), so a base row's drafts are all
    # accepted and a LoRA row's only where its adapter agrees with the base model
    adapters = sql_and_chat(dirs["target"], tmp_path_factory.mktemp("lora-draft"))
    spec = {"method": "draft_model", "model": str(dirs["target"]), "num_speculative_tokens": 3}
    runs = []
    for speculative in (None, spec):
        runner = _runner(dirs["target"], lora_adapters={k: str(v) for k, v in adapters.items()},
                         speculative=speculative)  # fmt: skip
        reqs = [Request(id=f"r{i}", model="lm", inputs=[p], max_new_tokens=30, lora=lora,
                        ignore_eos=True, return_token_ids=True)
                for i, (lora, p) in enumerate([(None, "a b c a b c a b"), ("sql", "a b c a b c"),
                                               ("chat", "it was the time of the year"),
                                               (None, "a b c a b c")])]  # fmt: skip
        finals, reports, _ = _answers(runner, reqs)
        runs.append(({k: v[0]["token_ids"] for k, v in finals.items()},
                     sum(r.drafted[1] for r in reports), sum(sum(r.accepted) for r in reports)))  # fmt: skip
    (plain, _, _), (got, drafted, accepted) = runs
    # Then: each row's tokens are those of its adapter without speculation (the adapters
    # change them), and the LoRA rows rejected drafts the base draft proposed
    assert got == plain and plain["r1"] != plain["r3"]
    assert 0 < accepted < drafted
