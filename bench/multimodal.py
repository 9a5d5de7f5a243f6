"""Images and rerankers: throughput at saturation against the offline limit, and padding
waste of native-resolution grouping (issue #14). CPU, one torch thread, ratios within a run.

1. **ViT, mixed-size images**: N requests of one image each (PNG/JPEG/WebP, 48-640 px,
   many aspect ratios) pre-queued, one worker loop in this process drains them (real Redis
   server: read, decode + preprocess on the loop thread, forward on the device thread,
   results stored). Offline: the same images decoded, preprocessed and run in batches of the
   same size, no queue.
2. **Padding waste, native resolution** (SigLIP 2 NaFlex, images keep their size up to the
   patch budget): the worker's batches (the engine groups similar patch counts) against the
   same trace cut into batches in arrival order; and the forward time of both batchings.
3. **Reranker, 1 query x 100 documents per request**: requests/s through the worker against
   encoding and scoring the same requests back to back offline.

Run: ``.venv/bin/python -m bench.multimodal [--quick] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import redis
import torch
from batchfleet.producer import Producer
from batchfleet.schemas.messages import Request
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runner import Prepared, PrepareError, StepReport, Work

from batchfleet.config import ModelConfig, WorkerConfig
from batchfleet.redis_server import LocalRedis

BATCH = 16
WORDS = ["the", "a", "of", "to", "and", "in", "is", "was", "for", "on", "that", "with", "as", "it", "by", "at", "from", "this", "be", "are", "or", "an", "not", "cat", "dog", "bird", "fish", "house", "river", "city", "night", "day", "light", "sound", "water", "stone", "tree", "road"]  # fmt: skip


# --- models and data ---------------------------------------------------------------------------


def _word_tokenizer(path: Path) -> None:
    from transformers import BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(WORDS))]
    tok = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    tok.save_pretrained(path)


def make_vit(path: Path) -> Path:
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    labels = {i: f"class-{i}" for i in range(10)}
    cfg = ViTConfig(image_size=128, patch_size=16, hidden_size=192, num_hidden_layers=4,
                    num_attention_heads=3, intermediate_size=384, id2label=labels,
                    label2id={v: k for k, v in labels.items()})  # fmt: skip
    ViTForImageClassification(cfg).save_pretrained(path)
    ViTImageProcessor(size={"height": 128, "width": 128}).save_pretrained(path)
    return path


def make_siglip2(path: Path) -> Path:
    from transformers import (
        Siglip2Config,
        Siglip2ForImageClassification,
        Siglip2ImageProcessor,
        Siglip2TextConfig,
        Siglip2VisionConfig,
    )

    torch.manual_seed(1)
    vision = Siglip2VisionConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                                 num_attention_heads=3, patch_size=16, num_patches=256)  # fmt: skip
    text = Siglip2TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
    cfg = Siglip2Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    cfg.id2label = {i: f"class-{i}" for i in range(10)}
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    Siglip2ForImageClassification(cfg).save_pretrained(path)
    Siglip2ImageProcessor(patch_size=16, max_num_patches=256).save_pretrained(path)
    return path


def make_reranker(path: Path) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(2)
    cfg = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=128, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=256, num_labels=1,
                     max_position_embeddings=256)  # fmt: skip
    BertForSequenceClassification(cfg).save_pretrained(path)
    _word_tokenizer(path)
    return path


def images(n: int, seed: int = 0) -> list[bytes]:
    """Encoded images of mixed sizes and aspect ratios (48-640 px a side)."""
    from PIL import Image

    rng = random.Random(seed)
    out = []
    for i in range(n):
        w, h = rng.randint(48, 640), rng.randint(48, 640)
        img = Image.new("RGB", (w, h), (rng.randrange(256), rng.randrange(256), 90))
        for _ in range(6):
            x, y = rng.randrange(w), rng.randrange(h)
            img.paste((rng.randrange(256), 40, rng.randrange(256)), (x, y, x + w // 4, y + h // 4))
        buf = io.BytesIO()
        img.save(buf, format=("PNG", "JPEG", "WEBP")[i % 3])
        out.append(buf.getvalue())
    return out


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


# --- measuring ---------------------------------------------------------------------------------


class Recorded:
    """A runner whose steps are recorded: each batch's rows and their cost features."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.name, self.device = runner.name, runner.device
        self.batches: list[list[int]] = []
        self.rows: list[list[Any]] = []
        self.first_step: float | None = None
        """perf_counter() when the first step began (the end of the worker's start-up)."""
        self.startup_s = 0.0
        """perf_counter() when the first step began (the end of the worker's start-up)."""

    def prepare_many(self, requests: Sequence[Request]) -> list[Prepared | PrepareError]:
        prepared: list[Prepared | PrepareError] = self.runner.prepare_many(requests)
        return prepared

    def step(self, work: Work) -> StepReport:
        if self.first_step is None:
            self.first_step = time.perf_counter()
        self.batches.append([p.tokens for _, p in work.admit for _ in range(p.rows)])
        self.rows.append([row for _, p in work.admit for row in p.payload])
        report: StepReport = self.runner.step(work)
        return report

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.runner.info()
        return info


def waste(batches: Sequence[Sequence[int]]) -> float:
    """Share of the computed (padded) patches or tokens that are padding."""
    padded = sum(len(b) * max(b) for b in batches)
    return 1 - sum(sum(b) for b in batches) / padded


def through_worker(
    url: str, model: str, runner: Any, requests: Sequence[dict[str, Any]], batch: int
) -> tuple[float, Recorded]:
    """Seconds for one worker loop to answer every pre-queued request (all must be ok),
    from its first step (its start-up, creating groups and the first read, excluded)."""
    client = redis.Redis.from_url(url)
    client.flushall()
    recorded = Recorded(runner)
    producer = Producer(client=client)
    jobs = [producer.submit(model, **kw) for kw in requests]
    cfg = ModelConfig(path="/unused", batch={"max_batch_size": batch, "max_wait_ms": 5})
    loop = BatchLoop(model, cfg, recorded, client, consumer="bench",
                     worker=WorkerConfig(block_ms=20), burst=True)  # fmt: skip
    start = time.perf_counter()
    loop.run()
    end = time.perf_counter()
    recorded.startup_s = (recorded.first_step or start) - start
    took = end - (recorded.first_step or start)
    bad = [r for r in (producer.peek(j) for j in jobs) if r is None or not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests not ok: {bad[:1]}")
    return took, recorded


def best(measure: Callable[[], tuple[float, Recorded]], runs: int = 2) -> tuple[float, Recorded]:
    """The fastest of ``runs`` worker runs (the offline side is timed the same way)."""
    return min((measure() for _ in range(runs)), key=lambda m: m[0])


def offline(runner: Any, requests: Sequence[Request], batch_rows: int) -> float:
    """Seconds to prepare and run ``requests`` in order, ``batch_rows`` rows a batch."""
    start = time.perf_counter()
    prepared = runner.prepare_many(requests)
    step: list[tuple[str, Prepared]] = []
    rows = 0
    for i, p in enumerate(prepared):
        assert isinstance(p, Prepared), p
        if step and rows + p.rows > batch_rows:
            runner.step(Work("offline", tuple(step)))
            step, rows = [], 0
        step.append((str(i), p))
        rows += p.rows
    if step:
        runner.step(Work("offline", tuple(step)))
    return time.perf_counter() - start


def replay(runner: Any, rows_by_batch: Sequence[Sequence[Any]]) -> float:
    """Forward seconds of given batch compositions (rows already prepared)."""
    start = time.perf_counter()
    for rows in rows_by_batch:
        runner.run(list(rows))
    return time.perf_counter() - start


@dataclass
class Line:
    what: str
    worker: str
    offline: str
    ratio: str


def _requests(model: str, inputs: Sequence[Any]) -> list[Request]:
    return [Request.model_validate({"id": f"r{i}", "model": model, "inputs": [x]})
            for i, x in enumerate(inputs)]  # fmt: skip


def run(quick: bool, tmp: Path, url: str) -> list[Line]:
    from batchfleet.worker.runners.image_classification import ImageClassificationRunner
    from batchfleet.worker.runners.rerank import RerankRunner

    lines: list[Line] = []
    n_img = 32 if quick else 480
    pics = images(n_img)

    # 1. ViT at saturation vs offline batched
    vit = ImageClassificationRunner(make_vit(tmp / "vit"), device="cpu", dtype="float32")
    offline(vit, _requests("vit", pics[:BATCH]), BATCH)  # warm up
    off = min(offline(vit, _requests("vit", pics), BATCH) for _ in range(2))
    took, rec = best(lambda: through_worker(url, "vit", vit, [{"images": [p]} for p in pics],
                                            BATCH))  # fmt: skip
    lines.append(Line(f"ViT, {n_img} mixed-size images, img/s ({len(rec.batches)} worker "
                      f"batches; offline in batches of {BATCH})", f"{n_img / took:.1f}",
                      f"{n_img / off:.1f}", _ratio(off, took, rec.startup_s)))  # fmt: skip

    # 2. Native resolution: the engine's grouping vs arrival order
    sig = ImageClassificationRunner(make_siglip2(tmp / "siglip2"), device="cpu", dtype="float32",
                                    options={"keep_native_resolution": True})  # fmt: skip
    prepared = [p for p in sig.prepare_many(_requests("sig", pics)) if isinstance(p, Prepared)]
    rows = [p.payload[0] for p in prepared]
    _, recorded = through_worker(url, "sig", sig, [{"images": [p]} for p in pics], BATCH)
    fifo = [rows[i : i + BATCH] for i in range(0, len(rows), BATCH)]
    fifo_waste = waste([[r.tokens for r in b] for b in fifo])
    grouped_waste = waste(recorded.batches)
    # what grouping buys at a fixed batch size: batches of similar patch counts vs arrival
    # order, the same images, forward only (best of two, alternating)
    ordered = sorted(rows, key=lambda r: r.tokens)
    similar = [ordered[i : i + BATCH] for i in range(0, len(ordered), BATCH)]
    replay(sig, fifo[:2])  # warm up
    t_similar = min(replay(sig, similar) for _ in range(2))
    t_fifo = min(replay(sig, fifo) for _ in range(2))
    sizes = [len(b) for b in recorded.batches]
    lines.append(Line(f"SigLIP 2 native resolution, {n_img} images: padding waste of the "
                      f"worker's {len(sizes)} batches (mean {sum(sizes) / len(sizes):.1f} rows) "
                      f"/ arrival order in batches of {BATCH}",
                      f"{grouped_waste:.1%}", f"{fifo_waste:.1%}", ""))  # fmt: skip
    lines.append(Line(f"  forward s, batches of {BATCH}: similar sizes / arrival order "
                      f"(waste {waste([[r.tokens for r in b] for b in similar]):.1%} / "
                      f"{fifo_waste:.1%})",
                      f"{t_similar:.2f}", f"{t_fifo:.2f}", f"{t_fifo / t_similar:.2f}x"))  # fmt: skip

    # 3. Reranker: 1 query x 100 documents per request
    rng = random.Random(3)
    n_rank = 4 if quick else 40
    rankings = [{"query": sentence(rng, 3, 8), "documents": [sentence(rng, 8, 40) for _ in range(100)]}
                for _ in range(n_rank)]  # fmt: skip
    rr = RerankRunner(
        make_reranker(tmp / "reranker"), device="cpu", dtype="float32", max_tokens=128
    )
    offline(rr, _requests("rr", rankings[:1]), 100)  # warm up
    off = min(offline(rr, _requests("rr", rankings), 100) for _ in range(2))
    took, rec = best(lambda: through_worker(url, "rr", rr, [dict(r) for r in rankings], 128))
    lines.append(Line(f"Reranker, {n_rank} requests of 1 query x 100 docs, req/s",
                      f"{n_rank / took:.2f}", f"{n_rank / off:.2f}",
                      _ratio(off, took, rec.startup_s)))  # fmt: skip
    return lines


def _ratio(offline_s: float, worker_s: float, startup_s: float) -> str:
    """Worker throughput over offline: from the first batch, and with the start-up."""
    return f"{offline_s / worker_s:.1%} ({offline_s / (worker_s + startup_s):.1%} with start-up)"


def table(lines: Sequence[Line]) -> str:
    out = ["| measurement | worker | offline / baseline | worker vs offline |",
           "| --- | ---: | ---: | ---: |"]  # fmt: skip
    out += [f"| {x.what} | {x.worker} | {x.offline} | {x.ratio} |" for x in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multimodal", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few dozen images: a smoke run")
    parser.add_argument("--out", type=Path, help="also write the table to OUT/<date>-multimodal.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with LocalRedis() as url, tempfile.TemporaryDirectory(prefix="bench-mm-") as tmp:
        lines = run(args.quick, Path(tmp), url)
    text = table(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = time.strftime("%Y-%m-%d") + "-multimodal.md"
        cmd = "python -m bench.multimodal" + (" --quick" if args.quick else "")
        (args.out / name).write_text(f"# Images and rerankers (`{cmd}`)\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
