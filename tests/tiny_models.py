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
