"""Tiny random-weight vision and pair models written with save_pretrained, with their real
processor and tokenizer configs, so tests use the real loading path; and real image files
of many sizes made with Pillow."""

from __future__ import annotations

import io
import random
from pathlib import Path

from tiny_models import _config, _tokenizer, vocab

IMAGE_LABELS = {0: "cat", 1: "dog", 2: "bird", 3: "fish"}


def make_vit(path: Path, size: int = 32) -> Path:
    """A ViT classifier over ``size``x``size`` images (fixed-size processor)."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(2)
    cfg = ViTConfig(
        image_size=size, patch_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, id2label=IMAGE_LABELS,
        label2id={v: k for k, v in IMAGE_LABELS.items()},
    )  # fmt: skip
    ViTForImageClassification(cfg).save_pretrained(path)
    ViTImageProcessor(size={"height": size, "width": size}).save_pretrained(path)
    return path


def make_siglip2_classifier(path: Path, max_num_patches: int = 64) -> Path:
    """A SigLIP 2 (NaFlex) classifier: native resolution, patch sequences with a mask."""
    import torch
    from transformers import (
        Siglip2Config,
        Siglip2ForImageClassification,
        Siglip2ImageProcessor,
        Siglip2TextConfig,
        Siglip2VisionConfig,
    )

    torch.manual_seed(3)
    vision = Siglip2VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        patch_size=8, num_patches=max_num_patches,
    )  # fmt: skip
    text = Siglip2TextConfig(
        vocab_size=len(vocab()), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    cfg = Siglip2Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    cfg.id2label = IMAGE_LABELS
    cfg.label2id = {v: k for k, v in IMAGE_LABELS.items()}
    Siglip2ForImageClassification(cfg).save_pretrained(path)
    Siglip2ImageProcessor(patch_size=8, max_num_patches=max_num_patches).save_pretrained(path)
    return path


def _towers(size: int, text_length: int) -> dict[str, dict[str, int]]:
    """Tiny text and vision tower configs of a two-tower model; texts end with [SEP] (3)."""
    text = {
        "vocab_size": len(vocab()), "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": text_length,
        "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3,
    }  # fmt: skip
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "image_size": size, "patch_size": 8,
    }  # fmt: skip
    return {"text_config": text, "vision_config": vision}


def _save_tokenizer(path: Path, max_length: int) -> None:
    tok = _tokenizer()
    tok.model_max_length = max_length
    tok.save_pretrained(path)


def make_clip(path: Path, size: int = 32) -> Path:
    """A CLIP model (image and text towers into one space) with a WordPiece tokenizer whose
    [SEP] ends a text (the text tower pools at the first end-of-text token)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(4)
    CLIPModel(CLIPConfig(**_towers(size, 64), projection_dim=16)).save_pretrained(path)
    CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(path)
    _save_tokenizer(path, 64)
    return path


def make_siglip(path: Path, size: int = 32) -> Path:
    """A SigLIP model: texts always padded to the tokenizer's max length (16 here), the
    text tower pools the last position."""
    import torch
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel

    torch.manual_seed(7)
    SiglipModel(SiglipConfig(**_towers(size, 16))).save_pretrained(path)
    SiglipImageProcessor(size={"height": size, "width": size}).save_pretrained(path)
    _save_tokenizer(path, 16)
    return path


def make_cross_encoder(path: Path) -> Path:
    """A BERT cross-encoder: one relevance logit per (query, document) pair."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(5)
    BertForSequenceClassification(_config(num_labels=1)).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


# --- image files ---------------------------------------------------------------------------

SIZES = [(32, 32), (64, 48), (17, 90), (120, 30), (45, 45), (200, 133), (8, 8), (99, 61)]
"""Widths x heights: squares, landscapes, portraits, tiny and odd sizes."""


def image_file(
    width: int, height: int, fmt: str = "PNG", seed: int = 0, mode: str = "RGB"
) -> bytes:
    """A real encoded image of random blocks (``fmt``: PNG, JPEG, WEBP, GIF, BMP...)."""
    from PIL import Image

    rng = random.Random(seed * 1_000_003 + width * 7919 + height)
    img = Image.new("RGB", (width, height))
    block = max(1, min(width, height) // 4)
    for x in range(0, width, block):
        for y in range(0, height, block):
            color = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
            img.paste(color, (x, y, min(width, x + block), min(height, y + block)))
    if mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def image_files(count: int, seed: int = 0) -> list[bytes]:
    """``count`` images cycling through :data:`SIZES` and PNG / JPEG / WebP."""
    formats = ["PNG", "JPEG", "WEBP"]
    return [
        image_file(*SIZES[i % len(SIZES)], fmt=formats[i % 3], seed=seed + i) for i in range(count)
    ]


def decompression_bomb(side: int = 20_000) -> bytes:
    """A small PNG that claims ``side`` x ``side`` pixels (a few KB on disk)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()
