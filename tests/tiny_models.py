"""Tiny random-weight BERT models written with save_pretrained, so tests use the real
loading path (AutoModel/AutoTokenizer from a directory) at a fraction of the cost."""

from __future__ import annotations

import string
from pathlib import Path

WORDS = [
    "the",
    "a",
    "an",
    "is",
    "are",
    "was",
    "of",
    "to",
    "and",
    "in",
    "on",
    "for",
    "with",
    "this",
    "that",
    "it",
    "be",
    "as",
    "at",
    "by",
    "from",
    "or",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "more",
    "if",
    "no",
    "out",
    "so",
    "up",
    "into",
    "than",
    "them",
    "only",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "quick",
    "brown",
    "fox",
    "jumps",
    "lazy",
    "dog",
]


def vocab() -> list[str]:
    letters = list(string.ascii_lowercase)
    return (
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        + sorted(set(WORDS))
        + letters
        + ["##" + c for c in letters]
        + list(string.digits)
        + list(".,!?'-")
    )


def _tokenizer():  # type: ignore[no-untyped-def]
    from transformers import BertTokenizer

    return BertTokenizer(vocab={w: i for i, w in enumerate(vocab())})


def _config(**extra):  # type: ignore[no-untyped-def]
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(vocab()),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        **extra,
    )


def make_embedding_model(path: Path) -> Path:
    import torch
    from transformers import BertModel

    torch.manual_seed(0)
    BertModel(_config()).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def make_classifier(path: Path) -> Path:
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(1)
    cfg = _config(id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    BertForSequenceClassification(cfg).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""SmolLM2's (ChatML) chat template, shortened."""


def make_causal_lm(
    path: Path, *, layers: int = 2, hidden: int = 64, seed: int = 0, context: int = 1024,
    sharp: float = 12.0, specials: tuple[str, ...] = (), eos_tokens: tuple[str, ...] = (),
    template: str | None = None,
) -> Path:  # fmt: skip
    """A tiny random Llama with a byte-level BPE tokenizer (trained here on WORDS) and a
    chat template, saved like a hub model (config, weights, tokenizer, generation config);
    ``context``: its max_position_embeddings. ``sharp``: its query and key projections
    scaled by this, so that its attention is peaked: a random model's is near uniform, and
    then keys read from the wrong place (a cache bug) change nothing a test can see.
    ``specials``: more special tokens (the vocabulary grows by them); ``eos_tokens``: those of
    them that end a sequence too (the generation config's); ``template``: the chat
    template (default :data:`CHAT_TEMPLATE`)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *specials]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20 + ["héllo wörld ünïcode ✓ 日本"] * 5, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = template or CHAT_TEMPLATE
    fast.save_pretrained(path)
    eos, pad = fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("<|endoftext|>")
    cfg = LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=context, eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(sharp)
            layer.self_attn.k_proj.weight.mul_(sharp)
    model.save_pretrained(path)
    ends = [eos, *(fast.convert_tokens_to_ids(t) for t in eos_tokens)] if eos_tokens else eos
    GenerationConfig(eos_token_id=ends, pad_token_id=pad).save_pretrained(path)
    return path


def make_gpt_oss(path: Path, *, window: int = 8, context: int = 1024, seed: int = 0) -> Path:
    """A tiny random gpt-oss (its layers alternate a sliding window of ``window`` tokens
    and full attention, with attention sinks and a mixture of experts), with
    :func:`make_causal_lm`'s tokenizer and chat template."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedTokenizerFast

    make_causal_lm(path, context=context)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    rope = {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": context,
            "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}  # fmt: skip
    cfg = GptOssConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=window, max_position_embeddings=context,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=rope,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    GptOssForCausalLM(cfg).save_pretrained(path)
    return path
