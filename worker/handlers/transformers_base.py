"""Shared machinery of the transformers handlers: load, tokenize, pad, run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedModel

from ..device import pick_device, pick_dtype, to_device
from .base import Encoded


class TransformersHandler:
    """Base for handlers over a Hugging Face model directory (offline; fast tokenizer).

    Subclasses set ``name``, implement ``_load_model`` and ``_outputs``.
    """

    name = "transformers"

    def __init__(
        self,
        path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_tokens: int = 512,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.options = dict(options or {})
        self.torch_device = pick_device(device)
        self.device = str(self.torch_device)
        self.dtype = pick_dtype(dtype, self.torch_device)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{path}: batchfleet needs a fast (Rust) tokenizer (tokenizer.json)")
        self.model: PreTrainedModel = self._load_model(str(path))
        self.model.to(self.torch_device).eval()
        limit = getattr(self.model.config, "max_position_embeddings", None) or max_tokens
        self.max_tokens = min(max_tokens, int(limit), int(tokenizer.model_max_length or limit))
        # A private copy: truncation on, padding off (we pad per batch, to its longest row).
        self._tok = Tokenizer.from_str(backend.to_str())
        self._tok.no_padding()
        self._tok.enable_truncation(self.max_tokens)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self._uses_type_ids = "token_type_ids" in tokenizer.model_input_names

    def _load_model(self, path: str) -> PreTrainedModel:
        raise NotImplementedError

    def _outputs(self, model_out: Any, mask: torch.Tensor) -> list[Any]:
        raise NotImplementedError

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        return [
            Encoded(ids=tuple(e.ids), type_ids=tuple(e.type_ids), truncated=bool(e.overflowing))
            for e in self._tok.encode_batch(list(texts))
        ]

    def collate(self, rows: Sequence[Encoded]) -> dict[str, torch.Tensor]:
        """Pad to the longest row in this batch (never to max_tokens)."""
        width = max(r.tokens for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = row.tokens
            ids[i, :n] = torch.tensor(row.ids, dtype=torch.long)
            types[i, :n] = torch.tensor(row.type_ids, dtype=torch.long)
            mask[i, :n] = 1
        batch = {"input_ids": ids, "attention_mask": mask}
        if self._uses_type_ids:
            batch["token_type_ids"] = types
        return {k: to_device(v, self.torch_device) for k, v in batch.items()}

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        inputs = self.collate(rows)
        with torch.inference_mode():
            out = self.model(**inputs)
            return self._outputs(out, inputs["attention_mask"])

    def info(self) -> dict[str, Any]:
        return {
            "handler": self.name,
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_tokens": self.max_tokens,
        }
