"""Image-text embeddings (CLIP, SigLIP, SigLIP 2): texts and images into one space.

Each input is a text or an image; its output is the model's text or image features
(``get_text_features`` / ``get_image_features``), L2-normalised, so a text and an image
compare by dot product. A batch may hold both: each tower runs once on its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel, PreTrainedModel

from ...schemas.inputs import AnyInput
from ..runner import Encoded
from .transformers_base import TransformersRunner
from .vision import ImagePrep, PixelRow, TakesImages

FIXED_LENGTH_TEXT = frozenset({"siglip", "siglip2"})
"""Models trained on texts padded to the tokenizer's max length (their text tower pools
the last position): their texts are always padded to it, as their processor does."""


class ImageTextEmbeddingRunner(TakesImages, TransformersRunner):
    """Options: ``normalize`` (default true), ``keep_native_resolution`` (vision.py)."""

    name = "image-text-embedding"
    accepts = frozenset({"text", "image"})

    def __init__(self, path: str | Path | None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        assert path is not None
        self.images = ImagePrep(
            path, self.model.config, self.torch_device, self.dtype, self.options
        )
        if self.model.config.model_type in FIXED_LENGTH_TEXT:
            self.pad_width = self.max_tokens

    def _load_model(self, path: str) -> PreTrainedModel:
        model = AutoModel.from_pretrained(path, dtype=self.dtype)
        if not hasattr(model, "get_image_features") or not hasattr(model, "get_text_features"):
            raise TypeError(f"{path}: {type(model).__name__} is not an image-text model")
        return model

    def encode(self, inputs: Sequence[AnyInput]) -> list[Any]:
        texts = [t for t in inputs if isinstance(t, str)]
        encoded = iter(super().encode(texts) if texts else [])
        return [
            next(encoded) if isinstance(item, str) else self.images.prepare(item, f"inputs[{i}]")
            for i, item in enumerate(inputs)
        ]

    def run(self, rows: Sequence[Any]) -> list[Any]:
        texts = [i for i, r in enumerate(rows) if isinstance(r, Encoded)]
        images = [i for i, r in enumerate(rows) if isinstance(r, PixelRow)]
        out: list[Any] = [None] * len(rows)
        with torch.inference_mode():
            if texts:
                batch = self.collate([rows[i] for i in texts])
                # as the model's processor calls it: SigLIP's tokenizer gives no mask
                mask = {"attention_mask": batch["attention_mask"]} if self._uses_mask else {}
                feats = self.model.get_text_features(input_ids=batch["input_ids"], **mask)
                self._place(out, texts, feats)
            if images:
                batch = self.images.collate([rows[i] for i in images])
                self._place(out, images, self.model.get_image_features(**batch))
        return out

    def _place(self, out: list[Any], where: list[int], feats: Any) -> None:
        vectors = feats if isinstance(feats, torch.Tensor) else feats.pooler_output
        vectors = vectors.float()
        if self.options.get("normalize", True):
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
        for i, vec in zip(where, vectors.cpu().tolist(), strict=True):
            out[i] = vec

    def info(self) -> dict[str, Any]:
        return {
            **super().info(),
            "native_resolution": self.images.native,
            "host_buffer_allocations": self.images.allocations + self._buffers.allocations,
        }
