"""``python bench/lora.py``: what multi-LoRA serving costs a padded-engine step.

The engine alone (no runner, no Redis), the benchmark's random 4-layer Llama (hidden 256,
``tests/tiny_models.py``; ``--model gpt2``: a random 4-layer GPT-2 of the same size, whose
steps run transformers' forwards, as does the Llama with ``--no-lean``), one torch thread:
``--rows`` sequences of 64-token prompts decode greedily, and the mean time of a decode
step over them is measured, in rounds that alternate the arms:

- ``base``: an engine without adapters (the code path of every model without
  ``lora_adapters``; run this file against an older checkout for "before", with
  ``--arms base``);
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


TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "c_attn", "c_proj", "c_fc"}  # fmt: skip
"""The linear layers an adapter here targets: a Llama's projections, GPT-2's Conv1Ds."""


def adapter(path: Path, model: Any, rank: int, seed: int) -> Path:
    """A LoRA adapter of every decoder layer's linear layer of ``model`` in PEFT's files
    (random A and B)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for where, module in model.named_modules():
        if where.rsplit(".", 1)[-1] not in TARGETS:
            continue
        w = module.weight  # a Linear's is outputs x inputs, a Conv1D's inputs x outputs
        inputs, outputs = (w.shape[1], w.shape[0]) if hasattr(module, "in_features") else w.shape
        key = f"base_model.model.{where}.lora_"
        tensors[key + "A.weight"] = torch.randn(rank, inputs, generator=gen) / inputs**0.5
        tensors[key + "B.weight"] = torch.randn(outputs, rank, generator=gen) / rank**0.5
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
    p.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    p.add_argument("--no-lean", action="store_true", help="transformers' forwards (Llama)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    from batchfleet.worker.generation.padded import PaddedEngine
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    tiny: Any = importlib.import_module("tiny_models")
    with tempfile.TemporaryDirectory() as tmp:
        lm = Path(tmp) / "lm"
        if args.model == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            torch.manual_seed(0)
            GPT2LMHeadModel(GPT2Config(vocab_size=400, n_positions=1024, n_embd=256,
                                       n_layer=4, n_head=4, bos_token_id=0,
                                       eos_token_id=0)).save_pretrained(lm)  # fmt: skip
        else:
            tiny.make_causal_lm(lm, layers=4, hidden=256, sharp=1.0)
        model = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).eval()
        kw = {"eos_token_ids": [0], "step_tokens": 512, "max_running": args.rows,
              "max_context": 1024, "lean": False if args.no_lean else None}  # fmt: skip
        engines = {"base": PaddedEngine(model, **kw)}
        if set(args.arms) - {"base"}:
            from batchfleet.worker.generation.lora import load

            loaded = tuple(load(f"a{k}", adapter(Path(tmp) / f"a{k}", model, args.rank, k),
                                model, 512) for k in (1, 2))  # fmt: skip
            engines["lora"] = PaddedEngine(model, adapters=loaded, **kw)
        prompts = [[(7 * i + j) % 300 + 3 for j in range(64)] for i in range(args.rows)]
        loras = {"base": [0] * args.rows, "loaded": [0] * args.rows, "one": [1] * args.rows,
                 "mixed": [i % 3 for i in range(args.rows)]}  # fmt: skip
        lean = engines["base"].lean is not None
        print(f"{args.model} ({'lean' if lean else 'transformers'} forward), {args.rows} rows, "
              f"64-token prompts, rank {args.rank}, {args.steps} decode steps an arm, one "
              "torch thread")  # fmt: skip
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
