"""The runners' ``matmul_precision`` (``worker/precision.py``): ``medium`` keeps a float32
model's linear layers' weights in bfloat16 and their results in float32, the product
``linear`` computes (Llama's, Qwen2's biased, GPT-2's ``Conv1D``); the runner's model,
draft model and encoders get it, ``highest`` leaves the model alone, a bad value is a
startup error, a device without fast bfloat16 or a 16-bit model keeps its products;
LoRA adapters (lean forward and hooks) add their float32 update to the mixed product;
the paged engine runs the converted modules."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from tiny_models import make_causal_lm, make_embedding_model

torch = pytest.importorskip("torch")

from batchfleet.worker import precision  # noqa: E402
from batchfleet.worker.precision import MixedConv1D, MixedLinear  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402

OPTIONS = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 16}


@pytest.fixture(autouse=True)
def bf16_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CPU counts as having fast bfloat16 (emulated or not, the numbers are the
    same), so the tests run the conversion on any machine."""
    monkeypatch.setattr(precision, "fast_bf16", lambda device: True)


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


def _runner(path: Path, dtype: str = "float32", **opts: Any) -> TextGenerationRunner:
    return TextGenerationRunner(path, device="cpu", dtype=dtype, options=OPTIONS | opts)


def _linears(model: Any) -> list[Any]:
    """Its plain linear layers, converted or not (not subclasses: ``nn.MultiheadAttention``'s
    ``out_proj``, whose weight that module multiplies by itself, stays as it is)."""
    return [m for m in model.modules() if type(m) in (torch.nn.Linear, MixedLinear)]


def test_medium_keeps_the_linear_weights_in_bf16_and_their_results_in_float32(lm: Path) -> None:
    runner = _runner(lm, matmul_precision="medium")
    model = runner.model
    layers = _linears(model)
    # every linear layer (the LM head too) is converted; the rest stays float32
    assert layers and all(type(m) is MixedLinear for m in layers)
    assert all(m.weight.dtype == torch.bfloat16 for m in layers)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.model.norm.weight.dtype == torch.float32
    assert runner.info()["matmul_precision"] == "medium" and runner.info()["decode"] == "lean"
    with torch.inference_mode():
        x = torch.randn(3, 5, model.config.hidden_size)
        head = model.lm_head(x)
        logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    # the product of x rounded to bf16, rounded to bf16 (autocast's), back in float32
    want = torch.nn.functional.linear(x.bfloat16(), model.lm_head.weight).float()
    assert head.dtype == torch.float32 and torch.equal(head, want)
    assert logits.dtype == torch.float32


def test_a_bias_is_added_in_float32_after_the_product() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Linear(16, 8)
    weight, bias = plain.weight.detach().clone(), plain.bias.detach().clone()
    precision.to_bf16(plain)
    x = torch.randn(4, 16)
    with torch.inference_mode():
        got = plain(x)
    product = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()).float()
    assert plain.bias.dtype == torch.float32 and torch.equal(got, product + bias)
    assert torch.allclose(got, x @ weight.T + bias, atol=0.05)


def test_gpt2_s_conv1d_keeps_its_layout_and_multiplies_the_same_way() -> None:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(8, 16)  # 16 inputs, 8 outputs: weight 16 x 8
    torch.nn.init.normal_(conv.bias)
    weight, bias = conv.weight.detach().clone(), conv.bias.detach().clone()
    x = torch.randn(2, 3, 16)
    with torch.inference_mode():
        before = conv(x)
    assert precision.to_bf16(conv) == 1
    with torch.inference_mode():
        got = conv(x)
    assert type(conv) is MixedConv1D and tuple(conv.weight.shape) == (16, 8)
    assert conv.weight.dtype == torch.bfloat16 and got.shape == (2, 3, 8)
    want = (x.bfloat16() @ weight.bfloat16()).float() + bias
    assert torch.equal(got, want) and torch.allclose(got, before, atol=0.05)


def test_a_weight_shared_by_two_layers_is_converted_once_and_stays_shared() -> None:
    first, second = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
    second.weight = first.weight
    model = torch.nn.Sequential(first, second)
    assert precision.to_bf16(model) == 2
    assert first.weight is second.weight and first.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("value", [None, "highest"])
def test_highest_leaves_the_model_as_it_is(lm: Path, value: str | None) -> None:
    runner = _runner(lm, **({} if value is None else {"matmul_precision": value}))
    layers = _linears(runner.model)
    assert all(type(m) is torch.nn.Linear for m in layers)
    assert all(m.weight.dtype == torch.float32 for m in layers)
    assert runner.info()["matmul_precision"] == "highest"


@pytest.mark.parametrize("value", ["low", "MEDIUM", 1, True])
def test_a_bad_value_is_a_startup_error_naming_the_option(lm: Path, value: Any) -> None:
    with pytest.raises(ValueError, match=r"options\.matmul_precision"):
        _runner(lm, matmul_precision=value)


def test_without_fast_bf16_a_warning_says_so_and_the_model_stays_float32(
    lm: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(precision, "fast_bf16", lambda device: False)
    with caplog.at_level(logging.WARNING, logger=precision.__name__):
        runner = _runner(lm, matmul_precision="medium")
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "no fast bfloat16" in warned[0].getMessage()
    assert all(type(m) is torch.nn.Linear for m in _linears(runner.model))
    assert runner.info()["matmul_precision"] == "highest"


def test_the_probe_asks_for_native_bf16_dot_products(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the real probe
    caps = dict(torch.cpu.get_capabilities())
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    caps.update({"avx512_bf16": False, "amx_bf16": False})
    assert not precision.fast_bf16(torch.device("cpu"))
    caps["amx_bf16"] = True
    mkldnn = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert precision.fast_bf16(torch.device("cpu")) is bool(mkldnn)


@pytest.mark.parametrize("dtype,value", [("bfloat16", "medium"), ("float32", "high")])
def test_where_there_is_nothing_to_do_the_model_keeps_its_products(
    lm: Path, dtype: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A 16-bit model (``medium``); ``high`` on a CPU, which has no TF32: an info line."""
    with caplog.at_level(logging.INFO, logger=precision.__name__):
        runner = _runner(lm, dtype=dtype, matmul_precision=value)
    assert [r.levelno for r in caplog.records if r.name == precision.__name__] == [logging.INFO]
    assert all(type(m) is torch.nn.Linear for m in _linears(runner.model))
    assert runner.info()["matmul_precision"] == "highest"


def test_an_encoder_runner_takes_it_too(tmp_path: Path) -> None:
    from batchfleet.worker.runners.embedding import EmbeddingRunner

    path = make_embedding_model(tmp_path / "bert")
    texts = ["the man was there", "a b c it what is this"]
    plain = EmbeddingRunner(path, device="cpu", dtype="float32")
    medium = EmbeddingRunner(path, device="cpu", dtype="float32",
                             options={"matmul_precision": "medium"})  # fmt: skip
    assert medium.info()["matmul_precision"] == "medium"
    assert _linears(medium.model) and all(type(m) is MixedLinear for m in _linears(medium.model))
    want, got = plain.run(plain.encode(texts)), medium.run(medium.encode(texts))
    for a, b in zip(want, got, strict=True):
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0)
        assert a != b and cosine > 0.999
    with pytest.raises(ValueError, match=r"options\.matmul_precision"):
        EmbeddingRunner(path, device="cpu", dtype="float32", options={"matmul_precision": "x"})


def test_the_draft_model_follows_the_target_s_precision(lm: Path) -> None:
    runner = _runner(lm, matmul_precision="medium",
                     speculative={"method": "draft_model", "model": str(lm),
                                  "num_speculative_tokens": 3})  # fmt: skip
    draft: Any = runner.engine.speculative  # type: ignore[attr-defined]
    assert all(type(m) is MixedLinear for m in _linears(draft.model))
    assert draft.lean is not None and draft.lean.layers[0].qkv.dtype == torch.bfloat16


def test_the_paged_engine_runs_the_converted_modules(lm: Path) -> None:
    from test_paged_prefix import _engine, _hf, _run

    runner = _runner(lm, matmul_precision="medium", engine="paged")
    model = runner.model
    assert type(model.lm_head) is MixedLinear
    prompts = {f"p{i}": [(7 * i + 5 * j) % 300 + 3 for j in range(4 + 9 * i)] for i in range(4)}
    got = _run(_engine(model, sharing=False), prompts, new=8)
    for name, tokens in prompts.items():
        assert got[name] == _hf(model, tokens, 8), name


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hooks"])
def test_lora_adapters_add_their_float32_update_to_the_mixed_product(
    lm: Path, lean: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The reference: PEFT's own (unmerged) LoRA layers over the converted base layers,
    one request at a time with ``generate``: its update is computed on the float32 input
    and added to the base layer's float32 result, as the engine's."""
    pytest.importorskip("peft")
    from test_generation_lora import check_mixed_batch, sql_and_chat

    adapters = sql_and_chat(lm, tmp_path_factory.mktemp("adapters"))
    runner = _runner(lm, matmul_precision="medium", lean_decode=lean,
                     lora_adapters={k: str(v) for k, v in adapters.items()})  # fmt: skip
    assert (runner.engine.lean is not None) is lean  # type: ignore[attr-defined]
    models = {None: runner.model, **{k: _peft(lm, v) for k, v in adapters.items()}}

    def reference(lora: str | None, text: str, n: int) -> list[int]:
        ids = runner.tokenizer(text, return_tensors="pt").input_ids
        model = models[lora]
        out = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False,
                             pad_token_id=runner.eos[0],
                             eos_token_id=runner.model.config.vocab_size)  # fmt: skip
        return [int(t) for t in out[0, ids.shape[1] :]]

    check_mixed_batch(runner, reference)


def _peft(lm: Path, adapter: Path) -> Any:
    """PEFT's own (unmerged) LoRA model of ``adapter`` with every base linear layer
    converted (``medium``) and the adapter's layers float32."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    for path, module in model.named_modules():  # all but the adapter's own
        if type(module) is torch.nn.Linear and ".lora_" not in path:
            precision.to_bf16(module)
    return model


def test_a_lora_update_is_computed_on_the_float32_input_in_both_forwards(
    lm: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One prompt's logits under an adapter: the lean forward's fused update and the
    hooks' are PEFT's (to float32 rounding; an update of bfloat16 inputs is ~1e-3 off)."""
    import numpy as np

    pytest.importorskip("peft")
    from batchfleet.worker.generation import lora
    from batchfleet.worker.generation.lean_decode import Chunk, LeanDecoder
    from batchfleet.worker.generation.lora_hooks import LoraHooks
    from batchfleet.worker.generation.padded_cache import _cache
    from test_generation_lora import make_adapter
    from transformers import AutoModelForCausalLM

    where = make_adapter(tmp_path_factory.mktemp("adapter") / "sql", lm, seed=1)
    model = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).eval()
    precision.to_bf16(model)
    adapter = lora.fuse(lora.load("sql", where, model, 64), model)
    assert adapter is not None and adapter.fused is not None
    lean = LeanDecoder.build(model)
    assert lean is not None
    ids = [(7 * j) % 300 + 3 for j in range(23)]
    none = torch.zeros(0, dtype=torch.long)
    with torch.inference_mode():
        want = _peft(lm, where)(input_ids=torch.tensor([ids])).logits[0, -1]
        with LoraHooks(model, [adapter]).rows([1]):
            hooked = model(input_ids=torch.tensor([ids])).logits[0, -1]
        fused = lean.forward(none, none, np.zeros(0, np.int64), [], [Chunk(ids, 0, _cache())],
                             lora=[(adapter.fused, torch.arange(len(ids)))])[-1]  # fmt: skip
        plain = model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert not torch.allclose(plain, want, atol=0.1)  # the adapter changes the logits
    assert torch.allclose(hooked, want, atol=2e-5), (hooked - want).abs().max()
    assert torch.allclose(fused, want, atol=2e-5), (fused - want).abs().max()


@pytest.mark.parametrize("which", ["siglip2", "clip"])
def test_image_runners_take_it_too(which: str, request: pytest.FixtureRequest) -> None:
    """SigLIP 2's patch embedding is a linear layer whose weight's dtype its pixels are cast
    to: the layer still answers in float32, as the rest of the model expects."""
    from batchfleet.worker.runners.image_classification import ImageClassificationRunner
    from batchfleet.worker.runners.image_text import ImageTextEmbeddingRunner
    from tiny_vision import image_files

    if which == "siglip2":
        cls: Any = ImageClassificationRunner
        path, kw = request.getfixturevalue("tiny_siglip2"), {}
        opts: dict[str, Any] = {"keep_native_resolution": True}
    else:
        cls, path, kw, opts = ImageTextEmbeddingRunner, request.getfixturevalue("tiny_clip"), {
            "max_tokens": 64}, {}  # fmt: skip
    plain = cls(path, device="cpu", dtype="float32", options=opts, **kw)
    medium = cls(path, device="cpu", dtype="float32", options=opts | {"matmul_precision": "medium"},
                 **kw)  # fmt: skip
    assert medium.info()["matmul_precision"] == "medium"
    assert all(type(m) is MixedLinear for m in _linears(medium.model))
    if which == "siglip2":
        patches = medium.model.vision_model.embeddings.patch_embedding
        pixels = torch.zeros(1, patches.in_features, dtype=torch.bfloat16)
        assert type(patches) is MixedLinear and patches(pixels).dtype == torch.float32
    images = image_files(3)
    want, got = plain.run(plain.encode(images)), medium.run(medium.encode(images))
    for a, b in zip(want, got, strict=True):
        if which == "siglip2":
            a, b = list(a["scores"].values()), list(b["scores"].values())
        assert a != b and torch.allclose(torch.tensor(a), torch.tensor(b), atol=0.02)
