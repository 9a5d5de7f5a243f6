"""``python bench/spec.py``: what n-gram and draft-model speculative decoding give a
padded-engine run.

The engine alone (no runner, no Redis), the benchmark's random 4-layer Llama (hidden 256,
``tests/tiny_models.py``), one torch thread. The workload copies: each prompt is a
passage written twice over (a document and an edit of it, as a summary or a rewrite
repeats its source), and each sequence generates ``--new`` tokens greedily (or sampled at
``--temperature``, seeded). A random
model does not copy its prompt, but its greedy text falls into loops of its own, which
the n-gram lookup then predicts; the acceptance printed says how much of the speedup is
that (a real model copying a real passage accepts at its own rate).

Arms alternate, per round: ``--rows`` sequences at once (batched) and one at a time
(``--one`` of them, in turn), each without speculation (``off``) and with
``{method = "ngram", num_speculative_tokens = --k, prompt_lookup_min = 1,
prompt_lookup_max = 3}`` (``ngram``) and with ``{method = "draft_model",
num_speculative_tokens = --k}`` (``draft``: a 1-layer Llama of the same hidden size drawn
from the same seed, so its layer is the target's first). Prints tokens/s per arm and
round, each speculating arm's acceptance rate (accepted / proposed) and mean tokens a row
emits per step it proposed in, and the medians; it checks that the arms generated the
same tokens. With ``--disable-by-batch-size N``, two arms more: ``ngram+b`` and
``draft+b``, the same with vLLM's ``disable_by_batch_size = N`` (no drafts in a step where
``N`` or more sequences run: the batched arm runs ``--rows`` at once).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run(
    engine: Any, prompts: list[list[int]], new: int, temperature: float = 0.0
) -> tuple[float, dict[str, list[int]]]:
    """Seconds to generate ``new`` tokens for every prompt at once, and the tokens."""
    from batchfleet.worker.generation.sampling import Sampling

    engine.forget_all()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add(f"s{i}", p, new, Sampling(temperature=temperature, seed=i, ignore_eos=True))
    done: dict[str, list[int]] = {}
    while len(done) < len(prompts):
        for o in engine.step():
            if o.finished:
                done[o.sequence] = o.tokens
    return time.perf_counter() - start, done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/spec.py", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16, help="sequences in the batched arm")
    p.add_argument("--one", type=int, default=4, help="sequences run one at a time")
    p.add_argument("--new", type=int, default=96, help="tokens each sequence generates")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample (seeded; rejection sampling) instead of greedy")  # fmt: skip
    p.add_argument("--disable-by-batch-size", type=int, default=None, metavar="N",
                   help="add the ngram+b and draft+b arms: no drafts where N or more run")  # fmt: skip
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import random

    import torch

    torch.set_num_threads(1)
    from batchfleet.worker.generation.draft import DraftProposer
    from batchfleet.worker.generation.padded import PaddedEngine
    from batchfleet.worker.generation.spec_bound import BatchBound
    from batchfleet.worker.generation.speculative import DraftConfig, NgramConfig
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    tiny: Any = importlib.import_module("tiny_models")
    with tempfile.TemporaryDirectory() as tmp:
        lm = Path(tmp) / "lm"
        tiny.make_causal_lm(lm, layers=4, hidden=256, sharp=1.0)
        model = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).eval()
        small = Path(tmp) / "draft"
        tiny.make_causal_lm(small, layers=1, hidden=256, sharp=1.0)
        draft = AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32).eval()
        rng = random.Random(0)
        vocab = model.config.vocab_size
        prompts = []
        for _ in range(args.rows):
            passage = [rng.randrange(3, vocab) for _ in range(48)]
            edit = [t if rng.random() > 0.1 else rng.randrange(3, vocab) for t in passage]
            prompts.append(passage + edit)
        kw = {"eos_token_ids": [0], "step_tokens": 512, "max_running": args.rows,
              "max_context": 1024}  # fmt: skip
        spec = NgramConfig(args.k, 1, 3)
        proposer = DraftProposer(draft, DraftConfig(str(small), args.k), chunk=512)
        engines = {"off": PaddedEngine(model, **kw), "ngram": PaddedEngine(model, speculative=spec, **kw),
                   "draft": PaddedEngine(model, speculative=proposer, **kw)}  # fmt: skip
        if args.disable_by_batch_size is not None:
            bound = BatchBound(disable_by_batch_size=args.disable_by_batch_size)
            bounded = DraftProposer(draft, DraftConfig(str(small), args.k, bound), chunk=512)
            engines["ngram+b"] = PaddedEngine(
                model, speculative=NgramConfig(args.k, 1, 3, bound), **kw
            )
            engines["draft+b"] = PaddedEngine(model, speculative=bounded, **kw)
        print(f"llama ({'lean' if engines['off'].lean is not None else 'transformers'} forward), "
              f"96-token prompts, {args.new} new tokens each, k {args.k}, temperature "
              f"{args.temperature}, one torch thread")  # fmt: skip
        for engine in engines.values():  # warm-up
            run(engine, prompts[:2], 8)
        rates: dict[str, list[float]] = {}
        for k in range(args.rounds):
            for shape in ("batched", "one"):
                outs = {}
                for arm, engine in engines.items():
                    before = (list(engine.drafted), sum(engine.accepted))
                    if shape == "batched":
                        seconds, outs[arm] = run(engine, prompts, args.new, args.temperature)
                        tokens = args.rows * args.new
                    else:
                        seconds, tokens, outs[arm] = 0.0, 0, {}
                        for i in range(args.one):
                            s, o = run(engine, [prompts[i]], args.new, args.temperature)
                            seconds += s
                            tokens += args.new
                            outs[arm][f"{i}"] = o["s0"]
                    name = f"{shape:7s} {arm:7s}"
                    rates.setdefault(name, []).append(tokens / seconds)
                    line = f"round {k + 1} {name} {tokens / seconds:8.1f} tokens/s"
                    if arm != "off":
                        rows = engine.drafted[0] - before[0][0]
                        drafts = engine.drafted[1] - before[0][1]
                        accepted = sum(engine.accepted) - before[1]
                        line += (f"  acceptance {accepted / max(drafts, 1):.2f}, "
                                 f"{1 + accepted / max(rows, 1):.2f} tokens a row-step")  # fmt: skip
                    print(line, flush=True)
                if not args.temperature and any(o != outs["off"] for o in outs.values()):
                    print(f"round {k + 1} {shape}: the arms' tokens differ", file=sys.stderr)
                    return 1
        for name, r in rates.items():
            print(f"{name} median {statistics.median(r):8.1f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
