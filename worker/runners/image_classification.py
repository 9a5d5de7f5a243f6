"""Image classification: label, score and every label's probability for each image."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageClassification

from ...schemas.inputs import AnyInput
from .classification import label_scores
from .transformers_base import ModelDirRunner
from .vision import ImagePrep, PixelRow, TakesImages


class ImageClassificationRunner(TakesImages, ModelDirRunner):
    """``AutoModelForImageClassification`` with its ``AutoImageProcessor``. Images are decoded
    and preprocessed on the CPU side (``prepare_many``), one request at a time so a bad
    image fails only its own request. Options: ``keep_native_resolution`` (vision.py)."""

    name = "image-classification"
    accepts = frozenset({"image"})
    bulk_encode = False

    def __init__(self, path: str | Path | None, **kwargs: Any) -> None:
        kwargs.pop("max_tokens", None)  # no texts
        super().__init__(path, **kwargs)
        self.model = AutoModelForImageClassification.from_pretrained(str(path), dtype=self.dtype)
        self.model.to(self.torch_device).eval()
        self._set_precision(self.model)
        self.images = ImagePrep(str(path), self.model.config, self.torch_device, self.dtype,
                                self.options)  # fmt: skip

    def encode(self, inputs: Sequence[AnyInput]) -> list[PixelRow]:
        return [self.images.prepare(item, f"inputs[{i}]") for i, item in enumerate(inputs)]

    def run(self, rows: Sequence[PixelRow]) -> list[Any]:
        inputs = self.images.collate(list(rows))
        with torch.inference_mode():
            logits = self.model(**inputs).logits
        return label_scores(logits, self.model.config)

    def info(self) -> dict[str, Any]:
        return {
            "runner": self.name,
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "matmul_precision": self.matmul_precision,
            "native_resolution": self.images.native,
            "host_buffer_allocations": self.images.allocations,
        }
