"""``python bench/lora.py``: what multi-LoRA serving costs a padded-engine step.

The engine alone (no runner, no Redis), the benchmark's random 4-layer Llama (hidden 256,
``tests/tiny_models.py``), one torch thread: ``--rows`` sequences of 64-token prompts
decode greedily, and the mean time of a decode step over them is measured, in rounds
that alternate the arms:

- ``base``: an engine without adapters (the code path of every model without
  ``lora_adapters``; run this file against an older checkout for "before");
- ``loaded``: two rank-``--rank`` adapters (every projection) loaded, every row the base
  model's (what adapter-less requests pay once adapters are configured);
- ``one``: every row under one adapter;
- ``mixed``: the rows split between the two adapters and the base model.

Adapters are written here in PEFT's layout (random A and B), read by
:mod:`batchfleet.worker.generation.lora`. Prints milliseconds per step, per arm and round.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def adapter(path: Path, model: Any, rank: int, seed: int) -> Path:
    """A LoRA adapter of every projection of ``model`` in PEFT's files (random A and B)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(model.model.layers):
        for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                            ("mlp", ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
            for name in names:
                lin = getattr(getattr(layer, part), name)
                key = f"base_model.model.model.layers.{i}.{part}.{name}.lora_"
                tensors[key + "A.weight"] = torch.randn(rank, lin.in_features, generator=gen)
                tensors[key + "B.weight"] = torch.randn(lin.out_features, rank, generator=gen)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": "all-linear"}
        )
    )
    return path


def step_ms(engine: Any, prompts: list[list[int]], loras: list[int], steps: int) -> float:
    """Mean ms of a decode step once every sequence runs (``loras``: per sequence, its
    adapter; all 0: added as an engine without adapters takes them)."""
    from batchfleet.worker.generation.sampling import Sampling

    engine.forget_all()
    greedy = Sampling(ignore_eos=True)
    for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
        extra = {"lora": lora} if lora else {}
        engine.add(f"s{i}", p, steps + 64, greedy, **extra)
    while engine.running < len(prompts):
        engine.step()
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) * 1e3 / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/lora.py", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", nargs="+", default=["base", "loaded", "one", "mixed"],
                   choices=["base", "loaded", "one", "mixed"])  # fmt: skip
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    from batchfleet.worker.generation.padded import PaddedEngine
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    tiny: Any = importlib.import_module("tiny_models")
    with tempfile.TemporaryDirectory() as tmp:
        lm = tiny.make_causal_lm(Path(tmp) / "lm", layers=4, hidden=256, sharp=1.0)
        model = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).eval()
        kw = {"eos_token_ids": [0], "step_tokens": 512, "max_running": args.rows,
              "max_context": 1024}  # fmt: skip
        engines = {"base": PaddedEngine(model, **kw)}
        if set(args.arms) - {"base"}:
            from batchfleet.worker.generation.lora import load

            loaded = tuple(load(f"a{k}", adapter(Path(tmp) / f"a{k}", model, args.rank, k),
                                model, 512) for k in (1, 2))  # fmt: skip
            engines["lora"] = PaddedEngine(model, adapters=loaded, **kw)
        prompts = [[(7 * i + j) % 300 + 3 for j in range(64)] for i in range(args.rows)]
        loras = {"base": [0] * args.rows, "loaded": [0] * args.rows, "one": [1] * args.rows,
                 "mixed": [i % 3 for i in range(args.rows)]}  # fmt: skip
        print(f"{args.rows} rows, 64-token prompts, rank {args.rank}, {args.steps} decode "
              "steps an arm, one torch thread")  # fmt: skip
        times: dict[str, list[float]] = {a: [] for a in args.arms}
        step_ms(engines["base"], prompts[:2], [0, 0], 5)  # warm-up
        for k in range(args.rounds):
            for arm in args.arms:
                engine = engines["base" if arm == "base" else "lora"]
                times[arm].append(step_ms(engine, prompts, loras[arm], args.steps))
                print(f"round {k + 1} {arm:6s} {times[arm][-1]:6.2f} ms/step", flush=True)
        for arm, t in times.items():
            print(f"{arm:6s} median {statistics.median(t):6.2f} ms/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
