"""``batchfleet from-vllm`` writes vLLM's pooling models as the worker's encoder runners:
the runner from ``--runner``/``--convert``/``--task`` or the model's ``config.json`` as
vLLM decides it, ``--pooler-config`` and the model's sentence-transformers pooling as the
runner's options, what only text generation takes listed; the runners start from the
files written (tiny BERTs saved with save_pretrained)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from vllm_commands import run, started_runner

TEXTS = ["the quick brown fox", "hi"]


def folder(tmp_path: Path, name: str, architectures: list[str], **config: Any) -> Path:
    """A model folder with only its config.json (what from-vllm reads), and optionally
    sentence-transformers' modules (``st``: the pooling mode key, ``normalize``)."""
    st, normalize = config.pop("st", None), config.pop("normalize", False)
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": architectures, **config}))
    if st is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})  # fmt: skip
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        modes = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken")
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 32, **{m: m == st for m in modes}}))  # fmt: skip
    return path


def model_of(tmp_path: Path, argv: list[str]) -> tuple[dict[str, Any], str, str]:
    """The one model's table, the fleet file's text and stderr (the file must load)."""
    code, fleet, _, stderr = run(tmp_path, argv)
    assert code == 0, stderr
    ((_, model),) = fleet["models"].items()
    return model, (tmp_path / "fleet.toml").read_text(), stderr


def test_runner_pooling_writes_an_embedding_model_that_embeds(
    tmp_path: Path, tiny_embedder: Path
) -> None:
    pytest.importorskip("torch")
    argv = ["vllm", "serve", str(tiny_embedder), "--runner", "pooling", "--served-model-name",
            "emb", "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "16",
            "--max-num-batched-tokens", "2k"]  # fmt: skip
    model, text, _ = model_of(tmp_path, argv)
    assert (model["runner"], model["max_tokens"]) == ("embedding", 64)
    assert model["batch"] == {"max_batch_size": 16, "max_batch_tokens": 2000}
    # a BertModel without sentence-transformers modules: vLLM pools its CLS token
    assert model["options"] == {"pooling": "cls"}
    assert "limits" not in model and "max_new_tokens" not in text
    many, _, _ = model_of(tmp_path, [*argv, "--max-num-seqs", "8192"])  # vLLM's bound is higher
    assert many["batch"]["max_batch_size"] == 4096
    runner, cfg = started_runner(tmp_path, argv, "emb")
    assert runner.max_tokens == 64 and cfg.batch.max_batch_size == 16
    vectors = runner.run(runner.encode(TEXTS))
    assert len(vectors) == 2 and all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4)
                                     for v in vectors)  # fmt: skip
    first = runner.run(runner.encode(["hi"]))[0]  # CLS of "hi" alone, as in the batch
    assert max(abs(a - b) for a, b in zip(first, vectors[1], strict=True)) < 1e-4


def test_convert_classify_writes_a_classifier_that_classifies(
    tmp_path: Path, tiny_classifier: Path
) -> None:
    pytest.importorskip("torch")
    argv = ["serve", str(tiny_classifier), "--convert", "classify", "--served-model-name", "cls",
            "--max-model-len", "32"]  # fmt: skip
    model, _, _ = model_of(tmp_path, argv)
    assert (model["runner"], model["max_tokens"]) == ("text-classification", 32)
    assert "options" not in model
    runner, _ = started_runner(tmp_path, argv, "cls")
    (out,) = runner.run(runner.encode(["what a day"]))
    assert set(out["scores"]) == {"negative", "neutral", "positive"}


@pytest.mark.parametrize(("flags", "activation"), [
    ([], "sigmoid"),  # vLLM scores a cross-encoder through a sigmoid by default
    (["--task", "score"], "sigmoid"),
    (["--pooler-config", '{"use_activation": false}'], "none"),
])  # fmt: skip
def test_a_cross_encoder_becomes_a_rerank_model_that_scores(
    tmp_path: Path, tiny_reranker: Path, flags: list[str], activation: str
) -> None:
    pytest.importorskip("torch")
    argv = ["serve", str(tiny_reranker), "--served-model-name", "rr", *flags]
    model, _, _ = model_of(tmp_path, argv)
    assert model["runner"] == "rerank" and model["options"] == {"activation": activation}
    runner, _ = started_runner(tmp_path, argv, "rr")
    from batchfleet.schemas.inputs import TextPair

    pairs = [TextPair(text="a query", text_pair=d) for d in ("a document", "another one")]
    scores = runner.run(runner.encode(pairs))
    assert len(scores) == 2
    assert all(0 < s < 1 for s in scores) is (activation == "sigmoid")


@pytest.mark.parametrize(("config", "expect"), [
    ('{"pooling_type": "MEAN"}', {"pooling": "mean"}),
    ('{"seq_pooling_type": "LAST", "normalize": false}', {"pooling": "last", "normalize": False}),
    ('{"use_activation": true, "pooling_type": "CLS"}', {"normalize": True, "pooling": "cls"}),
    ('{"dimensions": 64, "enable_chunked_processing": false}', {"pooling": "cls"}),
])  # fmt: skip
def test_pooler_config_keys_become_the_embedding_runners_options(
    tmp_path: Path, config: str, expect: dict[str, Any]
) -> None:
    path = folder(tmp_path, "enc", ["BertModel"])
    model, _, _ = model_of(tmp_path, ["serve", str(path), "--pooler-config", config])
    assert model["runner"] == "embedding" and model["options"] == expect


@pytest.mark.parametrize(("config", "needless", "listed"), [
    ('{"dimensions": 64}', False, "--pooler-config dimensions=64: vectors are not shortened"),
    ('{"enable_chunked_processing": true}', False,
     "--pooler-config enable_chunked_processing=true: inputs are cut"),
    ('{"enable_chunked_processing": false}', True,
     "--pooler-config enable_chunked_processing=false: inputs are cut"),
    ('{"max_embed_len": 8192}', False, "--pooler-config max_embed_len=8192: inputs are cut"),
    ('{"tok_pooling_type": "ALL"}', False, '--pooler-config tok_pooling_type="ALL": token emb'),
    ('{"pooling_type": "STEP"}', False, '--pooler-config pooling_type="STEP": token emb'),
    ('{"logit_bias": 1.5}', False, "--pooler-config logit_bias=1.5: classifiers' logits"),
    ('{"returned_token_ids": [1, 2]}', False, "--pooler-config returned_token_ids=[1, 2]: the"),
    ('{"frobnicate": 1}', False, "--pooler-config frobnicate=1: not a key of vLLM"),
])  # fmt: skip
def test_pooler_config_keys_without_equivalent_are_listed(
    tmp_path: Path, config: str, needless: bool, listed: str
) -> None:
    path = folder(tmp_path, "enc", ["BertModel"])
    _, text, stderr = model_of(tmp_path, ["serve", str(path), "--pooler-config", config])
    section = text.split("# No equivalent")[0 if needless else 1]
    assert f"#   {listed}" in section
    assert (f"no equivalent: {listed}" in stderr) is not needless


def test_a_classifiers_pooler_keys_it_cannot_change_are_listed(tmp_path: Path) -> None:
    path = folder(tmp_path, "nli", ["BertForSequenceClassification"], num_labels=3)
    argv = ["serve", str(path), "--pooler-config", '{"pooling_type": "MEAN", "softmax": false}']
    model, text, stderr = model_of(tmp_path, argv)
    assert model["runner"] == "text-classification" and "options" not in model
    assert "no equivalent: --pooler-config pooling_type=\"MEAN\": the text-classification " \
           "runner's head pools" in stderr  # fmt: skip
    assert "no equivalent: --pooler-config softmax=false: the classifier answers probabilities" \
        in stderr  # fmt: skip
    _, text, _ = model_of(tmp_path, ["serve", str(path), "--pooler-config",
                                     '{"use_activation": true}'])  # fmt: skip
    assert "#   --pooler-config use_activation=true: the classifier answers" in text


def test_generation_only_flags_are_listed_as_not_applying(
    tmp_path: Path, tiny_embedder: Path
) -> None:
    argv = ["serve", str(tiny_embedder), "--runner", "pooling", "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3", "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}', "--block-size", "16",
            "--enable-lora", "--lora-modules", "sql=/loras/sql", "--max-loras", "2",
            "--chat-template", "{{ x }}", "--no-enable-prefix-caching",
            "--generation-config", "/cfg", "--max-num-seqs", "8"]  # fmt: skip
    model, text, stderr = model_of(tmp_path, argv)
    assert model["options"] == {"pooling": "cls"}
    assert model["batch"] == {"max_batch_size": 8}
    assert "lora_adapters" not in model["options"]
    for listed in ("--tool-call-parser hermes: tool_call_parser applies to text generation "
                   "(the embedding runner)", "--reasoning-parser qwen3: reasoning_parser",
                   "--speculative-config", "--block-size 16: page_size",
                   "--max-loras 2: max_loras", "--chat-template {{ x }}: chat_template",
                   "--no-enable-prefix-caching: prefix_cache_tokens",
                   "--generation-config /cfg: generation_config",
                   "--lora-modules sql=/loras/sql: the embedding runner serves no LoRA",
                   "--enable-lora: the embedding runner serves no LoRA"):  # fmt: skip
        assert f"no equivalent: {listed}" in stderr, listed
    assert "--enable-lora: LoRA adapters are served" not in text  # a generator's reason


@pytest.mark.parametrize(("architectures", "config", "flags", "runner", "options"), [
    (["BertModel"], {}, [], "embedding", {"pooling": "cls"}),
    (["XLMRobertaModel"], {"st": "pooling_mode_cls_token", "normalize": True}, [], "embedding",
     {"pooling": "cls", "normalize": True}),
    (["BertModel"], {"st": "pooling_mode_mean_tokens"}, [], "embedding",
     {"pooling": "mean", "normalize": False}),
    (["Qwen3ForCausalLM"], {"st": "pooling_mode_lasttoken", "normalize": True}, [], "embedding",
     {"pooling": "last", "normalize": True}),
    (["Qwen3ForCausalLM"], {}, ["--runner", "pooling"], "embedding", {"pooling": "last"}),
    (["Qwen3ForCausalLM"], {}, ["--convert", "embed"], "embedding", {"pooling": "last"}),
    (["LlamaForCausalLM"], {}, [], "text-generation", None),
    (["XLMRobertaForSequenceClassification"], {"id2label": {"0": "a", "1": "b"}}, [],
     "text-classification", None),
    (["XLMRobertaForSequenceClassification"], {"num_labels": 1}, [], "rerank",
     {"activation": "sigmoid"}),
    (["BertForSequenceClassification"], {"id2label": {"0": "s"},
     "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, [],
     "rerank", {"activation": "none"}),
    (["BertModel"], {}, ["--task", "embed"], "embedding", {"pooling": "cls"}),
    (["BertModel"], {}, ["--task", "embedding", "--pooler-config", '{"pooling_type": "MEAN"}'],
     "embedding", {"pooling": "mean"}),
    (["BertForSequenceClassification"], {}, ["--task", "classify"], "text-classification",
     None),
    (["BertModel"], {}, ["--runner", "generate"], "text-generation", None),
    (["BertModel"], {}, ["--task", "auto", "--convert", "none"], "embedding", {"pooling": "cls"}),
])  # fmt: skip
def test_the_runner_is_decided_as_vllm_decides_it(
    tmp_path: Path, architectures: list[str], config: dict[str, Any], flags: list[str],
    runner: str, options: dict[str, Any] | None,
) -> None:  # fmt: skip
    path = folder(tmp_path, "m", architectures, **config)
    model, text, _ = model_of(tmp_path, ["serve", str(path), *flags])
    assert model["runner"] == runner
    for flag in (f for f in flags if f.startswith("--")):  # each cited, as every flag is
        assert f"{flag} " in text.split("\n", 1)[1], flag
    if options is not None:
        assert model["options"] == options


def test_a_hub_id_is_generative_unless_the_flags_say_pooling(tmp_path: Path) -> None:
    model, _, _ = model_of(tmp_path, ["serve", "intfloat/e5-base"])
    assert model["runner"] == "text-generation"  # its config.json is not here to read
    model, _, stderr = model_of(tmp_path, ["serve", "intfloat/e5-base", "--convert", "embed"])
    assert model["runner"] == "embedding" and "options" not in model  # the runner's mean
    assert "no equivalent: the model's pooling: its folder is not here to read" in stderr
    model, text, _ = model_of(tmp_path, ["serve", "BAAI/bge-reranker", "--task", "classify"])
    assert model["runner"] == "text-classification"
    assert 'a cross-encoder, one output, needs runner = "rerank"' in text


@pytest.mark.parametrize(("architectures", "config", "flags", "why"), [
    (["Qwen2ForRewardModel"], {}, [], "no reward-model runner"),
    (["BertModel"], {}, ["--convert", "reward"], "no reward-model runner"),
    (["BertForTokenClassification"], {}, [], "token classification"),
    (["BertForTokenClassification"], {}, ["--runner", "pooling"], "token classification"),
    (["ViTForImageClassification"], {}, [], 'write runner = "image-classification" by hand'),
    (["WhisperForConditionalGeneration"], {}, ["--task", "transcription"], "speech-to-text"),
    (["BertModel"], {}, ["--runner", "draft"], "--speculative-config"),
    (["BertModel"], {}, ["--runner", "encode"], "vLLM takes auto, generate, pooling"),
    (["BertModel"], {}, ["--convert", "rerank"], "vLLM takes auto, none, embed"),
    (["BertModel"], {}, ["--task", "rank"], "vLLM took auto, generate"),
    (["LlamaForCausalLM"], {}, ["--runner", "generate", "--convert", "embed"],
     "--runner pooling only"),
    (["BertForSequenceClassification"], {"num_labels": 3}, ["--task", "score"],
     "one output, not 3"),
    (["BertModel"], {}, ["--pooler-config", '{"pooling_type": "MAX"}'], "pools by MEAN"),
    (["BertModel"], {}, ["--pooler-config", "[1]"], "a JSON object"),
])  # fmt: skip
def test_pooling_models_the_fleet_does_not_serve_are_refused(
    tmp_path: Path, architectures: list[str], config: dict[str, Any], flags: list[str], why: str
) -> None:
    path = folder(tmp_path, "m", architectures, **config)
    code, _, _, stderr = run(tmp_path, ["serve", str(path), *flags])
    assert code == 2
    assert why in stderr


def test_pooler_config_of_a_generative_model_needs_nothing(tmp_path: Path) -> None:
    path = folder(tmp_path, "lm", ["LlamaForCausalLM"])
    argv = [
        "serve",
        str(path),
        "--runner",
        "generate",
        "--pooler-config",
        '{"pooling_type": "LAST"}',
    ]
    model, text, stderr = model_of(tmp_path, argv)
    assert model["runner"] == "text-generation"
    assert "#   --runner generate: a generative model" in text.split("# No equivalent")[0]
    assert "#   --pooler-config" in text and "--pooler-config" not in stderr


def test_a_generative_model_converted_to_embed_embeds_its_last_token(
    tmp_path: Path, tiny_lm: Path
) -> None:
    """vLLM's ``--convert embed`` of a causal LM: its base model's states, last token pooled."""
    pytest.importorskip("torch")
    argv = ["serve", str(tiny_lm), "--convert", "embed", "--served-model-name", "lm-embed",
            "--dtype", "float32", "--max-model-len", "128"]  # fmt: skip
    model, _, _ = model_of(tmp_path, argv)
    assert model["runner"] == "embedding" and model["options"] == {"pooling": "last"}
    runner, _ = started_runner(tmp_path, argv, "lm-embed")
    batch = runner.run(runner.encode(TEXTS))
    alone = runner.run(runner.encode(["hi"]))[0]  # padding does not reach the last token
    assert max(abs(a - b) for a, b in zip(alone, batch[1], strict=True)) < 1e-4


def st_folder(tmp_path: Path, architectures: list[str], modes: dict[str, Any] | None,
              new_types: bool = False, **config: Any) -> Path:  # fmt: skip
    """A config-only model folder with a sentence-transformers Pooling module whose
    ``config.json`` is ``modes`` (None: no modules), and a Normalize module
    (``new_types``: sentence-transformers 5's module types)."""
    path = folder(tmp_path, "m", architectures, **config)
    if modes is not None:
        pool, norm = (("sentence_transformers.sentence_transformer.modules.pooling.Pooling",
                       "sentence_transformers.base.modules.normalize.Normalize") if new_types
                      else ("sentence_transformers.models.Pooling",
                            "sentence_transformers.models.Normalize"))  # fmt: skip
        modules = [{"idx": 0, "name": "0", "path": "", "type": "x.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": pool},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": norm}]  # fmt: skip
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    return path


@pytest.mark.parametrize(("architectures", "config", "modes", "pooling"), [
    # no sentence-transformers pooling: the architecture's default, as vLLM's classes
    (["Qwen2Model"], {}, None, "last"),  # served as Qwen2ForCausalLM
    (["Gemma3TextModel"], {"model_type": "gemma3_text"}, None, "last"),
    (["LlamaModel"], {"model_type": "llama"}, None, "last"),
    (["MistralModel"], {}, None, "last"),
    (["ModernBertModel"], {"model_type": "modernbert"}, None, "cls"),
    (["XLMRobertaModel"], {"model_type": "xlm-roberta"}, None, "cls"),
    (["ElectraModel"], {}, None, "cls"),  # through vLLM's Transformers backend
    (["GritLM"], {"model_type": "mistral"}, None, "gritlm"),  # its own pooler
    # sentence-transformers' Pooling config as vLLM reads it
    (["BertModel"], {}, {"pooling_mode": "lasttoken"}, "last"),  # sentence-transformers 5
    (["BertModel"], {}, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
     "mean"),  # the last set in the file wins
    (["BertModel"], {}, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
     "cls"),
    (["BertModel"], {}, {"pooling_mode_mean_sqrt_len_tokens": True}, "mean"),
    # none vLLM pools by: the architecture's (``*`` marks it)
    (["BertModel"], {}, {"pooling_mode_max_tokens": True, "include_prompt": True}, "cls*"),
    (["Qwen2Model"], {}, {"pooling_mode_weightedmean_tokens": True}, "last*"),
    (["BertModel"], {}, {"pooling_mode": ["mean", "max"]}, "cls*"),
])  # fmt: skip
def test_the_default_pooling_is_vllms_for_the_architecture_and_modules(
    tmp_path: Path, architectures: list[str], config: dict[str, Any],
    modes: dict[str, Any] | None, pooling: str,
) -> None:  # fmt: skip
    path = st_folder(tmp_path, architectures, modes, **config)
    model, text, _ = model_of(tmp_path, ["serve", str(path), "--runner", "pooling"])
    assert model["runner"] == "embedding"
    assert model["options"]["pooling"] == pooling.rstrip("*")
    assert ("normalize" in model["options"]) is (modes is not None)
    assert ("none vLLM pools by" in text) is pooling.endswith("*")


@pytest.mark.parametrize("flags", [["--convert", "embed"], ["--runner", "pooling", "--convert",
                                   "embed"], ["--convert", "classify"], ["--convert", "reward"]])  # fmt: skip
def test_convert_leaves_a_gritlm_its_own_pooler_as_vllm_s_adapters_do(
    tmp_path: Path, flags: list[str]
) -> None:
    # vLLM's as_embedding_model and as_seq_cls_model return a pooling model's class as it
    # is: its GritLM embeds with its GritLM pooler whatever --convert asks
    path = st_folder(tmp_path, ["GritLM"], None, model_type="mistral")
    model, text, _ = model_of(tmp_path, ["serve", str(path), *flags])
    assert model["runner"] == "embedding"
    assert model["options"]["pooling"] == "gritlm"
    assert "a no-op for GritLM" in text


def test_sentence_transformers_5_module_types_are_read(tmp_path: Path) -> None:
    path = st_folder(tmp_path, ["BertModel"], {"pooling_mode": "mean"}, new_types=True)
    model, _, _ = model_of(tmp_path, ["serve", str(path)])
    assert model["runner"] == "embedding"
    assert model["options"] == {"pooling": "mean", "normalize": True}
