"""Shared machinery of the transformers runners: load, tokenize, collate, run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedModel

from ...schemas.inputs import AnyInput, Ranking, TextPair
from .. import precision
from ..device import pick_device, pick_dtype, to_device
from ..host_buffers import HostBuffers
from ..runner import BatchRunner, Encoded


class ModelDirRunner(BatchRunner):
    """Base of runners over a model directory: its device, dtype and options, and its
    model's ``matmul_precision`` (:mod:`..precision`; read here, before the weights load,
    and applied by :meth:`_set_precision` once they are on the device)."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        options: dict[str, Any] | None = None,
    ) -> None:
        if path is None:
            raise ValueError(f"the {self.name} runner needs `path`: a model directory")
        self.options = dict(options or {})
        self.torch_device = pick_device(device)
        self.device = str(self.torch_device)
        self.dtype = pick_dtype(dtype, self.torch_device)
        self.matmul_precision = precision.read(self.options.get("matmul_precision"))
        """The precision of the model's linear layers' products: the option, then the one
        in effect (:meth:`_set_precision`)."""

    def _set_precision(self, model: torch.nn.Module) -> None:
        """Apply ``matmul_precision`` to ``model`` (on its device, in eval mode)."""
        self.matmul_precision = precision.apply(model, self.matmul_precision,
                                                self.torch_device, "the model")  # fmt: skip


class TransformersRunner(ModelDirRunner):
    """Base for runners over a Hugging Face model directory (offline; fast tokenizer).

    Subclasses set ``name``, implement ``_load_model`` and ``_outputs``.
    """

    name = "transformers"
    pad_width: int | None = None
    """Pad every batch to this width (models trained on fixed-length text, e.g. SigLIP)."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_tokens: int = 512,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(path, device=device, dtype=dtype, options=options)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{path}: batchfleet needs a fast (Rust) tokenizer (tokenizer.json)")
        self.model: PreTrainedModel = self._load_model(str(path))
        self.model.to(self.torch_device).eval()
        self._set_precision(self.model)
        limit = getattr(self.model.config, "max_position_embeddings", None) or max_tokens
        self.max_tokens = min(max_tokens, int(limit), int(tokenizer.model_max_length or limit))
        # A private copy: truncation on, padding off (we pad per batch, to its longest row).
        self._tok = Tokenizer.from_str(backend.to_str())
        self._tok.no_padding()
        self._tok.enable_truncation(self.max_tokens)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self._uses_type_ids = "token_type_ids" in tokenizer.model_input_names
        self._uses_mask = "attention_mask" in tokenizer.model_input_names
        names = ["input_ids", "attention_mask"] + (
            ["token_type_ids"] if self._uses_type_ids else []
        )
        self._buffers = HostBuffers(names, pinned=self.torch_device.type == "cuda")

    def _load_model(self, path: str) -> PreTrainedModel:
        raise NotImplementedError

    def _outputs(self, model_out: Any, mask: torch.Tensor) -> list[Any]:
        raise NotImplementedError

    def _pooled_mask(self, rows: Sequence[Encoded], mask: torch.Tensor) -> torch.Tensor:
        """The tokens ``_outputs`` pools over: the real ones (a subclass may leave some
        out, as GritLM's instruction)."""
        return mask

    def encode(self, inputs: Sequence[AnyInput]) -> list[Encoded]:
        """Texts, and text pairs (a ranking as one pair per document) encoded together."""
        texts: list[Any] = list(inputs)
        if not all(type(t) is str for t in texts):
            texts = [p for item in inputs for p in _sequences(item)]
        return [
            Encoded(ids=tuple(e.ids), type_ids=tuple(e.type_ids), truncated=bool(e.overflowing))
            for e in self._tok.encode_batch(texts)
        ]

    def collate(self, rows: Sequence[Encoded]) -> dict[str, torch.Tensor]:
        """Pad to the longest row in this batch (never to max_tokens), in reused host
        buffers (pinned on CUDA), and copy them to the device.

        The buffers are refilled by the next batch: safe because a batch's outputs are
        read back to the host (which waits for the copy) before the next one is collated."""
        width = self.pad_width or max(r.tokens for r in rows)
        views = self._buffers.take(len(rows), width)
        ids, mask = views["input_ids"], views["attention_mask"]
        ids.fill_(self.pad_id)
        mask.zero_()
        types = views.get("token_type_ids")
        if types is not None:
            types.zero_()
        np_ids, np_mask = ids.numpy(), mask.numpy()
        np_types = types.numpy() if types is not None else None
        for i, row in enumerate(rows):
            n = row.tokens
            np_ids[i, :n] = row.ids
            np_mask[i, :n] = 1
            if np_types is not None and row.type_ids:
                np_types[i, :n] = row.type_ids
        return {k: to_device(v, self.torch_device) for k, v in views.items()}

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        inputs = self.collate(rows)
        with torch.inference_mode():
            out = self.model(**inputs)
            return self._outputs(out, self._pooled_mask(rows, inputs["attention_mask"]))

    def info(self) -> dict[str, Any]:
        return {
            "runner": self.name,
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "matmul_precision": self.matmul_precision,
            "max_tokens": self.max_tokens,
        }


def _sequences(item: AnyInput) -> list[str | tuple[str, str]]:
    """What the tokenizer encodes for one input: a text, a pair, or a pair per document."""
    if isinstance(item, TextPair):
        return [(item.text, item.text_pair)]
    if isinstance(item, Ranking):
        return [(item.query, doc) for doc in item.documents]
    if isinstance(item, str):
        return [item]
    raise TypeError(f"not a text input: {type(item).__name__}")
