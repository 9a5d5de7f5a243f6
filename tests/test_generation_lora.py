"""Multi-LoRA serving: PEFT adapters of tiny random models, loaded by the text-generation
runner, give in one continuous batch (with the base model's requests) the greedy tokens of
the base model with each adapter merged (peft's ``merge_and_unload``, HF ``generate``) —
on the lean forward (a Llama) and on transformers' forwards (the same Llama with
``lean_decode`` off, a GPT-2 with its ``Conv1D`` layers, a Qwen3, a Phi-3, a Gemma); the
same prompt under two adapters never shares keys and values; what is not served is
refused when the runner starts or the request is read."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import TINY_LM_OPTIONS, WorkerProcess, fleet_toml
from devices import DEVICE
from test_generation_runner import Driver, prepare, req
from tiny_models import make_causal_lm

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from batchfleet.producer import AsyncProducer, Producer  # noqa: E402
from batchfleet.schemas.errors import ErrorCode  # noqa: E402
from batchfleet.schemas.keys import ModelKeys  # noqa: E402
from batchfleet.schemas.messages import Limits  # noqa: E402
from batchfleet.schemas.model_info import decode_model_info  # noqa: E402
from batchfleet.worker.runner import PrepareError  # noqa: E402
from batchfleet.worker.runner_info import model_info  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402

OPTIONS = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 16}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["the man was", "a b c", "there were many years of time and", "it", "what is this"]
LONG = "there were many years of time and the man was a b c it what is this " * 2
"""A prompt of more than two 16-token blocks: the prefix cache holds it."""


def make_adapter(path: Path, base: Path, *, r: int = 8, alpha: float = 16,
                 targets: Any = ALL, seed: int = 1, **extra: Any) -> Path:  # fmt: skip
    """A PEFT LoRA adapter of the model at ``base``, saved by peft, with random non-zero
    A and B large enough to change the tiny model's greedy text."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, **extra)
    lora = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    lora.save_pretrained(path)
    return path


def merged(base: Path, adapter: Path) -> Any:
    """The base model with the adapter merged into its weights (peft's own merge)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module")
def adapters(lm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return sql_and_chat(lm, tmp_path_factory.mktemp("adapters"))


def sql_and_chat(lm: Path, root: Path) -> dict[str, Path]:
    """``sql``: every projection, r 8; ``chat``: q, v and down only, r 4, rsLoRA scaling."""
    return {
        "sql": make_adapter(root / "sql", lm, seed=1),
        "chat": make_adapter(root / "chat", lm, r=4, alpha=8, seed=2, use_rslora=True,
                             targets=["q_proj", "v_proj", "down_proj"]),
    }  # fmt: skip


Reference = Callable[[str | None, str, int], list[int]]
"""Greedy tokens of HF ``generate`` on the base model (None) or a merged adapter."""


def _runner(base: Path, adapters: dict[str, Path], **opts: Any) -> TextGenerationRunner:
    opts = OPTIONS | {"lora_adapters": {k: str(v) for k, v in adapters.items()}} | opts
    return TextGenerationRunner(base, device=DEVICE, dtype="float32", options=opts)


def _reference(base: Path, adapters: dict[str, Path], runner: TextGenerationRunner) -> Reference:
    on = runner.torch_device
    models = {None: runner.model, **{k: merged(base, v).to(on) for k, v in adapters.items()}}

    def greedy(lora: str | None, text: str, n: int) -> list[int]:
        ids = runner.tokenizer(text, return_tensors="pt").input_ids.to(on)
        model = models[lora]
        # ignore_eos: an end token never drawn (min_new_tokens would mask the real one out)
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=runner.eos[0],
                             eos_token_id=model.config.vocab_size)  # fmt: skip
        return [int(t) for t in out[0, ids.shape[1] :]]

    return greedy


@pytest.fixture(scope="module")
def runner(lm: Path, adapters: dict[str, Path]) -> TextGenerationRunner:
    return _runner(lm, adapters)


@pytest.fixture(scope="module")
def reference(lm: Path, adapters: dict[str, Path], runner: TextGenerationRunner) -> Reference:
    return _reference(lm, adapters, runner)


def make_other(path: Path, lm: Path, family: str, **config: Any) -> Path:
    """A tiny random ``family`` model (gpt2, qwen3, phi3, gemma, mistral) with ``lm``'s
    tokenizer, saved like ``lm`` (its query and key weights scaled up: peaked attention);
    ``config``: more of a Llama-shaped family's config (a Mistral's ``sliding_window``)."""
    from transformers import (
        AutoTokenizer,
        GemmaConfig,
        GemmaForCausalLM,
        GenerationConfig,
        GPT2Config,
        GPT2LMHeadModel,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    tok = AutoTokenizer.from_pretrained(lm)
    tok.save_pretrained(path)
    GenerationConfig.from_pretrained(lm).save_pretrained(path)
    eos, vocab = tok.convert_tokens_to_ids("<|im_end|>"), len(tok)
    torch.manual_seed(3)
    model: Any
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=64,
                                           n_layer=2, n_head=4, bos_token_id=eos,
                                           eos_token_id=eos))  # fmt: skip
        with torch.no_grad():  # c_attn is a Conv1D (inputs x outputs): q and k first
            for block in model.transformer.h:
                block.attn.c_attn.weight[:, :128].mul_(6.0)
    elif family == "phi3":  # q, k and v in one qkv_proj; gate and up in one gate_up_proj
        model = Phi3ForCausalLM(Phi3Config(vocab_size=vocab, hidden_size=64,
                                           intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=1024, eos_token_id=eos,
                                           pad_token_id=0, bos_token_id=eos,
                                           tie_word_embeddings=False))  # fmt: skip
        with torch.no_grad():  # q rows, then k (2 of 4 heads' worth)
            for layer in model.model.layers:
                layer.self_attn.qkv_proj.weight[:96].mul_(6.0)
    else:
        kind, make = {"gemma": (GemmaForCausalLM, GemmaConfig),
                      "mistral": (MistralForCausalLM, MistralConfig)}.get(
                          family, (Qwen3ForCausalLM, Qwen3Config))  # fmt: skip
        model = kind(make(**config, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, max_position_embeddings=1024, eos_token_id=eos,
                            pad_token_id=0, bos_token_id=eos, tie_word_embeddings=False))  # fmt: skip
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(6.0)
                layer.self_attn.k_proj.weight.mul_(6.0)
    model.save_pretrained(path)
    return path


WORLDS = ["llama-lean", "llama-transformers", "gpt2", "qwen3", "phi3", "gemma"]
"""A Llama on the lean forward, and models (or options) that run transformers' forwards."""


@pytest.fixture(scope="module", params=WORLDS)
def world(
    request: pytest.FixtureRequest, lm: Path, adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[TextGenerationRunner, Reference]:  # fmt: skip
    """A runner serving two adapters ``sql`` and ``chat``, and its reference."""
    which = request.param
    if which == "llama-lean":
        return request.getfixturevalue("runner"), request.getfixturevalue("reference")
    if which == "llama-transformers":
        run = _runner(lm, adapters, lean_decode=False)
        assert run.engine.lean is None  # type: ignore[attr-defined]
        return run, _reference(lm, adapters, run)
    base = make_other(tmp_path_factory.mktemp(which), lm, which)
    root = tmp_path_factory.mktemp(f"{which}-adapters")
    if which == "gpt2":  # Conv1D layers (fan_in_fan_out); c_attn is q, k and v in one
        own = {"sql": make_adapter(root / "sql", base, seed=1, fan_in_fan_out=True,
                                   targets=["c_attn", "c_proj", "c_fc"]),
               "chat": make_adapter(root / "chat", base, r=4, alpha=8, seed=2,
                                    use_rslora=True, fan_in_fan_out=True,
                                    targets=["attn.c_attn", "mlp.c_proj"])}  # fmt: skip
    elif which == "phi3":
        own = {"sql": make_adapter(root / "sql", base, seed=1, targets="all-linear"),
               "chat": make_adapter(root / "chat", base, r=4, alpha=8, seed=2, use_rslora=True,
                                    targets=["qkv_proj", "down_proj"])}  # fmt: skip
    else:
        own = {"sql": make_adapter(root / "sql", base, seed=1),
               "chat": make_adapter(root / "chat", base, r=4, alpha=8, seed=2, use_rslora=True,
                                    targets=["q_proj", "v_proj", "down_proj"])}  # fmt: skip
    run = _runner(base, own)
    assert run.engine.lean is None  # type: ignore[attr-defined]
    return run, _reference(base, own, run)


def test_adapters_and_the_base_in_one_continuous_batch_give_the_merged_models_tokens(
    world: tuple[TextGenerationRunner, Reference],
) -> None:
    check_mixed_batch(*world)


def check_mixed_batch(runner: TextGenerationRunner, reference: Reference) -> None:
    """Requests for the base, ``sql`` and ``chat`` joining one running batch over steps give
    their own models' greedy tokens (any engine)."""
    # Given: requests for the base, sql and chat, of different lengths, arriving over steps
    plan = [(None, 0, 6), ("sql", 1, 9), ("chat", 2, 12), ("sql", 0, 7), ("chat", 3, 10),
            (None, 4, 8), ("chat", 0, 5)]  # fmt: skip
    reqs = [req(f"r{i}", inputs=[PROMPTS[p]], max_new_tokens=n, lora=lora, ignore_eos=True,
                return_token_ids=True)
            for i, (lora, p, n) in enumerate(plan)]  # fmt: skip
    preps = prepare(runner, *reqs)
    d = Driver(runner)
    # When: they join the running batch at different steps
    d.step([("r0", preps[0]), ("r1", preps[1])])
    d.step([("r2", preps[2])])
    d.step()
    d.step([("r3", preps[3]), ("r4", preps[4])])
    d.step([("r5", preps[5]), ("r6", preps[6])])
    d.run()
    # Then: each gives its own model's greedy tokens
    for i, (lora, p, n) in enumerate(plan):
        got = d.finals[f"r{i}"].outputs[0]["token_ids"]
        assert got == reference(lora, PROMPTS[p], n), (i, lora)
    # and the adapters change the text (else the test would prove nothing)
    base = reference(None, PROMPTS[0], 6)
    assert reference("sql", PROMPTS[0], 6) != base != reference("chat", PROMPTS[0], 6)


def test_the_same_prompt_under_two_adapters_shares_no_prefill_nor_cached_prefix(
    world: tuple[TextGenerationRunner, Reference],
) -> None:
    runner, reference = world
    engine: Any = runner.engine
    # Given: one prompt for the base, sql and chat (and sql twice), read in one step
    loras = [None, "sql", "chat", "sql"]
    reqs = [req(f"t{i}", inputs=[LONG], max_new_tokens=5, lora=lora, ignore_eos=True,
                return_token_ids=True, cache_salt="same-prompt-test")
            for i, lora in enumerate(loras)]  # fmt: skip
    d = Driver(runner)
    shared = engine.shared
    d.step(list(zip([r.id for r in reqs], prepare(runner, *reqs), strict=True)))
    d.run()
    # Then: only the two sql requests shared a prefill; each has its model's tokens
    prompt = len(runner.tokenizer(LONG).input_ids)
    assert engine.shared - shared == prompt
    for i, lora in enumerate(loras):
        assert d.finals[f"t{i}"].outputs[0]["token_ids"] == reference(lora, LONG, 5), lora
    # When: the prompt comes back under chat, then under an adapter-less request
    again = [req("a0", inputs=[LONG], max_new_tokens=5, lora="chat", ignore_eos=True,
                 return_token_ids=True, cache_salt="same-prompt-test"),
             req("a1", inputs=[LONG], max_new_tokens=5, ignore_eos=True,
                 return_token_ids=True, cache_salt="same-prompt-test")]  # fmt: skip
    for r in again:
        d = Driver(runner)
        d.step([(r.id, prepare(runner, r)[0])])
        d.run()
        # Then: it starts from its own adapter's cached blocks, and gives its tokens
        out = d.finals[r.id].outputs[0]
        assert out["cached_tokens"] >= 32
        assert out["token_ids"] == reference(r.lora, LONG, 5), r.lora


def test_the_padded_batch_attention_path_applies_the_adapters_too(
    world: tuple[TextGenerationRunner, Reference],
) -> None:
    """The decode rows attended by sdpa over the padded batch (the path of a GPU or a
    16-bit dtype), engine alone: the same tokens."""
    from batchfleet.worker.generation.padded import PaddedEngine
    from batchfleet.worker.generation.sampling import Sampling

    runner, reference = world
    old: Any = runner.engine
    engine = PaddedEngine(runner.model, eos_token_ids=runner.eos, step_tokens=64,
                          max_running=8, row_attention=False, adapters=old.adapters,
                          lean=old.lean is not None)  # fmt: skip
    assert not engine.row_attention and (engine.lean is None) == (old.lean is None)
    plan = [(None, 0), ("sql", 1), ("chat", 2), ("sql", 3), ("chat", 0)]
    names = [None, *runner.lora_adapters]
    got: dict[str, list[int]] = {}
    for i, (lora, p) in enumerate(plan):
        ids = runner.tokenizer(PROMPTS[p]).input_ids
        engine.add(f"e{i}", ids, 7, Sampling(ignore_eos=True), lora=names.index(lora))
        got |= {o.sequence: o.tokens for o in engine.step()}  # joins as the others decode
    while engine.running or len(got) < len(plan):
        got |= {o.sequence: o.tokens for o in engine.step()}
    for i, (lora, p) in enumerate(plan):
        assert got[f"e{i}"] == reference(lora, PROMPTS[p], 7), (i, lora)


def test_adapters_go_on_through_hooks_where_the_lean_forward_fails_on_its_first_step(
    runner: TextGenerationRunner, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchfleet.worker.generation.lean_decode import LeanDecoder
    from batchfleet.worker.generation.padded import PaddedEngine
    from batchfleet.worker.generation.sampling import Sampling

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no kernel for this device")

    # Given: an engine with adapters whose lean forward cannot run here
    engine = PaddedEngine(runner.model, eos_token_ids=runner.eos, step_tokens=64,
                          max_running=8, adapters=runner.engine.adapters)  # type: ignore[attr-defined]  # fmt: skip
    assert engine.lean is not None
    with monkeypatch.context() as m:
        m.setattr(LeanDecoder, "forward", broken)
        engine.add("x", runner.tokenizer(PROMPTS[0]).input_ids, 5, Sampling(), lora=1)
        with pytest.raises(RuntimeError, match="no kernel"):
            engine.step()
    engine.reset()
    assert engine.lean is None
    # When: the base and both adapters run on transformers' forwards
    names = [None, *runner.lora_adapters]
    for i in range(len(names)):
        engine.add(f"f{i}", runner.tokenizer(PROMPTS[i]).input_ids, 6, Sampling(ignore_eos=True),
                   lora=i)  # fmt: skip
    got: dict[str, list[int]] = {}
    while len(got) < len(names):
        got |= {o.sequence: o.tokens for o in engine.step() if o.finished}
    # Then: each has its merged model's tokens
    for i, lora in enumerate(names):
        assert got[f"f{i}"] == reference(lora, PROMPTS[i], 6), lora


def test_an_adapter_of_a_module_the_lean_forward_does_not_run_takes_transformers_forwards(
    lm: Path, tmp_path: Path
) -> None:
    """A Llama with one more linear layer in its MLP (a variant the lean forward's
    products leave out): its adapter is served on transformers' forwards."""
    from batchfleet.worker.generation.lora import load
    from batchfleet.worker.generation.padded import PaddedEngine
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).eval()
    mlp = model.model.layers[0].mlp
    mlp.extra = torch.nn.Linear(64, 64, bias=False)
    path = tmp_path / "extra"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
    save_file({f"base_model.model.model.layers.0.mlp.{p}.lora_{w}.weight": torch.ones(shape)
               for p, shapes in (("extra", ((2, 64), (64, 2))), ("up_proj", ((2, 64), (128, 2))))
               for w, shape in zip("AB", shapes, strict=True)},
              str(path / "adapter_model.safetensors"))  # fmt: skip
    adapter = load("extra", path, model, 8)
    assert set(adapter.modules) == {"model.layers.0.mlp.extra", "model.layers.0.mlp.up_proj"}
    engine = PaddedEngine(model, eos_token_ids=[], step_tokens=64, max_running=4,
                          adapters=(adapter,))  # fmt: skip
    assert engine.lean is None
    assert PaddedEngine(model, eos_token_ids=[], step_tokens=64, max_running=4).lean is not None


def test_a_request_preempted_under_an_adapter_resumes_under_it(
    world: tuple[TextGenerationRunner, Reference],
) -> None:
    check_preempted(*world)


def check_preempted(runner: TextGenerationRunner, reference: Reference) -> None:
    """A request under ``chat`` preempted mid-generation resumes under it (any engine)."""
    (p,) = prepare(runner, req("pre", inputs=PROMPTS[2:4], max_new_tokens=12, lora="chat",
                               ignore_eos=True, return_token_ids=True))  # fmt: skip
    d = Driver(runner)
    d.step([("pre", p)])
    for _ in range(4):
        d.step()
    d.step(preempt=["pre"])
    d.step([("pre", p)])
    d.run()
    got = [o["token_ids"] for o in d.finals["pre"].outputs]
    assert got == [reference("chat", t, 12) for t in PROMPTS[2:4]]


def test_an_unknown_adapter_is_an_invalid_request_naming_the_known_ones(
    runner: TextGenerationRunner,
) -> None:
    (out,) = runner.prepare_many([req("x", lora="nope")])
    assert isinstance(out, PrepareError) and out.code == ErrorCode.INVALID_REQUEST
    assert "'nope'" in str(out) and "sql, chat" in str(out)


def test_the_model_info_lists_the_adapters(runner: TextGenerationRunner) -> None:
    assert model_info(runner, Limits(), 1).lora_adapters == ["sql", "chat"]


def _start(lm: Path, adapter: Path, **opts: Any) -> TextGenerationRunner:
    return TextGenerationRunner(
        lm,
        device=DEVICE,
        dtype="float32",
        options=OPTIONS | {"lora_adapters": {"bad": str(adapter)}} | opts,
    )


def test_adapters_that_are_not_served_are_refused_at_startup(
    lm: Path, adapters: dict[str, Path], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    def refused(adapter: Path, why: str, **opts: Any) -> None:
        with pytest.raises(ValueError, match=why) as info:
            _start(lm, adapter, **opts)
        assert "options.lora_adapters: adapter 'bad'" in str(info.value)

    # DoRA, a rank over the bound, a bias, modules_to_save, the LM head
    refused(make_adapter(tmp_path / "dora", lm, use_dora=True), "DoRA")
    refused(adapters["sql"], "rank 8 is over max_lora_rank 4", max_lora_rank=4)
    refused(make_adapter(tmp_path / "bias", lm, bias="lora_only"), "bias 'lora_only'")
    refused(make_adapter(tmp_path / "save", lm, modules_to_save=["lm_head"]), "modules_to_save")
    refused(make_adapter(tmp_path / "head", lm, targets=["q_proj", "lm_head"]), "lm_head")
    # an adapter of another base model (hidden 32): its shapes do not fit
    other = make_causal_lm(tmp_path_factory.mktemp("other"), hidden=32)
    refused(make_adapter(tmp_path / "other", other), r"do not fit the base")
    # a base with fewer layers than the adapter; an embedding (not a linear layer)
    deep = make_causal_lm(tmp_path_factory.mktemp("deep"), layers=3)
    refused(make_adapter(tmp_path / "deep", deep), "no module 'model.layers.2.")
    refused(make_adapter(tmp_path / "embed", lm, targets=["q_proj", "embed_tokens"]),
            "embed_tokens.*is not a LoRA weight of a linear layer")  # fmt: skip
    # a missing weights file, a missing config
    gone = make_adapter(tmp_path / "gone", lm)
    (gone / "adapter_model.safetensors").unlink()
    refused(gone, "adapter_model.safetensors is missing")
    refused(tmp_path / "nowhere", "cannot read adapter_config.json")
    # a bound out of range
    with pytest.raises(ValueError, match="max_lora_rank: 1024 is not 1 … 512"):
        _start(lm, adapters["sql"], max_lora_rank=1024)


def test_the_hooks_are_attached_for_a_forward_with_an_adapter_s_rows_alone(
    runner: TextGenerationRunner,
) -> None:
    """No adapter row: no hook on any module (the base model's forward as it is); else one
    on each module the used adapters target, removed after the forward."""
    from batchfleet.worker.generation.lora_hooks import LoraHooks

    adapters = runner.engine.adapters  # type: ignore[attr-defined]
    sql, chat = adapters
    hooks = LoraHooks(runner.model, adapters)

    def hooked() -> set[str]:
        return {n for n, m in runner.model.named_modules() if m._forward_hooks}

    with hooks.rows([0, 0, 0]):
        assert hooked() == set()
    with hooks.rows([0, 2, 0]):
        assert hooked() == set(chat.modules) and len(chat.modules) == 6
    with hooks.rows([1, 2]):
        assert hooked() == set(sql.modules) | set(chat.modules)
    assert hooked() == set()
    with pytest.raises(ZeroDivisionError), hooks.rows([1]):
        raise ZeroDivisionError  # a failed forward leaves no hook behind
    assert hooked() == set()


def test_an_adapter_written_by_hand_in_peft_s_layout_is_fused_per_product(
    lm: Path, tmp_path: Path
) -> None:
    """q and v of layer 1 only: the qkv product takes both A's along the rank and each B in
    its own rows (k's rows zero), scaled by alpha / r; layer 0 and the MLP take nothing."""
    from batchfleet.worker.generation.lora import fuse, load
    from safetensors.torch import save_file

    runner = _start(lm, make_adapter(tmp_path / "any", lm))
    attn = runner.model.model.layers[1].self_attn
    q, v, k_out = attn.q_proj, attn.v_proj, attn.k_proj.out_features
    a_q, a_v = torch.randn(2, q.in_features), torch.randn(2, v.in_features)
    b_q, b_v = torch.randn(q.out_features, 2), torch.randn(v.out_features, 2)
    path = tmp_path / "hand"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 3, "target_modules": ["q_proj", "v_proj"],
         "bias": "none", "fan_in_fan_out": False, "use_dora": False}))  # fmt: skip
    key = "base_model.model.model.layers.1.self_attn.{}.lora_{}.weight"
    save_file({key.format("q_proj", "A"): a_q, key.format("q_proj", "B"): b_q,
               key.format("v_proj", "A"): a_v, key.format("v_proj", "B"): b_v},
              str(path / "adapter_model.safetensors"))  # fmt: skip
    adapter = load("hand", path, runner.model, 64)
    assert set(adapter.modules) == {"model.layers.1.self_attn.q_proj",
                                    "model.layers.1.self_attn.v_proj"}  # fmt: skip
    laid = fuse(adapter, runner.model)
    assert laid is not None and laid.fused is not None
    fused = laid.fused
    assert fused[0] == {} and set(fused[1]) == {"qkv"}
    a, b = (t.cpu() for t in fused[1]["qkv"])
    assert torch.equal(a, torch.cat([a_q, a_v]))
    want = torch.zeros(q.out_features + k_out + v.out_features, 4)
    want[: q.out_features, :2] = b_q * 1.5
    want[q.out_features + k_out :, 2:] = b_v * 1.5
    assert torch.equal(b, want)
    # peft's all-linear shorthand is every projection, in every layer
    every = load("all", make_adapter(tmp_path / "all", lm, targets="all-linear", alpha=4),
                 runner.model, 64)  # fmt: skip
    assert every.scale == 0.5
    laid = fuse(every, runner.model)
    assert laid is not None and laid.fused is not None
    assert all(set(layer) == {"qkv", "o", "gate_up", "down"} for layer in laid.fused)
    # B without its A is refused
    save_file({key.format("q_proj", "B"): b_q}, str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="lora_A and lora_B are not both there"):
        load("hand", path, runner.model, 64)


def test_a_lean_engine_holds_each_adapter_s_weights_once(
    runner: TextGenerationRunner, lm: Path, adapters: dict[str, Path]
) -> None:
    """The lean engine's adapters keep their per-module updates (the hooks', where it falls
    back to transformers' forwards) as views of their fused products: no second copy,
    the same numbers as read; an engine without the lean forward keeps them as read and
    lays out nothing. (Its tokens: the tests above, the hooks' fallback included.)"""
    from batchfleet.worker.generation.lora import load, nbytes

    def storages(tensors: list[Any]) -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    engine: Any = runner.engine
    assert engine.lean is not None
    # the hooks read these adapters, not the ones read before they were laid out
    assert all(h is a for h, a in zip(engine._hooks.adapters, engine.adapters, strict=True))
    for adapter, path in zip(engine.adapters, adapters.values(), strict=True):
        read = load(adapter.name, path, runner.model, 64)
        assert adapter.fused is not None and read.fused is None
        fused = storages([t for layer in adapter.fused for u in layer.values() for t in u])
        # every module's A and B lie in a fused product's memory
        assert storages([t for u in adapter.modules.values() for t in u]).keys() <= fused.keys()
        assert nbytes(adapter) == sum(fused.values())
        # the views hold the numbers read, module by module
        assert adapter.modules.keys() == read.modules.keys()
        for where, (a, b) in read.modules.items():
            got_a, got_b = adapter.modules[where]
            assert torch.equal(got_a, a) and torch.equal(got_b, b), where
        # one copy: less than what was read and its fused layout kept side by side
        assert nbytes(adapter) < nbytes(read) + sum(fused.values())
    plain = _runner(lm, {"sql": adapters["sql"]}, lean_decode=False)
    (only,) = plain.engine.adapters  # type: ignore[attr-defined]
    assert only.fused is None
    assert nbytes(only) == sum(t.nbytes for u in only.modules.values() for t in u)


def start_gen_worker(redis_url: str, r: redis.Redis, lm: Path, sql: Path,
                     start_worker: Callable[..., WorkerProcess], extra: str = "",
                     name: str = "gen-1") -> None:  # fmt: skip
    """A worker ``name`` serving ``lm`` as ``gen`` with its adapter ``sql`` (``extra``:
    more of its fleet file), ready."""
    spec = {"runner": "text-generation", "path": str(lm), "options": TINY_LM_OPTIONS}
    fleet = fleet_toml(redis_url, {"gen": spec})
    fleet += f'[models.gen.options.lora_adapters]\nsql = "{sql}"\n{extra}'
    start_worker(fleet, name).wait_ready(r, "gen")


def test_a_worker_serves_an_adapter_to_the_producers(
    redis_url: str, r: redis.Redis, lm: Path, adapters: dict[str, Path],
    reference: Callable[[str | None, str, int], list[int]],
    start_worker: Callable[..., WorkerProcess],
) -> None:  # fmt: skip
    start_gen_worker(redis_url, r, lm, adapters["sql"], start_worker)
    info = decode_model_info(r.get(ModelKeys("gen").info) or b"")
    assert info.lora_adapters == ["sql"]
    with Producer(redis_url) as producer:
        job = producer.submit("gen", inputs=[PROMPTS[1]], lora="sql", max_new_tokens=6,
                              ignore_eos=True, return_token_ids=True)  # fmt: skip
        (out,) = job.result(timeout=60).generations()
        assert out.token_ids == reference("sql", PROMPTS[1], 6)
        bad = producer.submit("gen", inputs=[PROMPTS[1]], lora="nope").result(timeout=60)
        assert bad.error is not None and bad.error.code == ErrorCode.INVALID_REQUEST
        assert "sql" in bad.error.message

    async def base() -> list[int] | None:
        async with AsyncProducer(redis_url) as aio:
            job = await aio.submit("gen", inputs=[PROMPTS[1]], lora="sql", max_new_tokens=6,
                                   ignore_eos=True, return_token_ids=True)  # fmt: skip
            (out,) = (await job.result(timeout=60)).generations()
            return out.token_ids

    assert asyncio.run(base()) == reference("sql", PROMPTS[1], 6)
