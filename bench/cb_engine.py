"""Which continuous-batching engine the text-generation runner uses, and why.

Same prompts, same sized cache, greedy, in one process on the CPU:

- ``manager``: transformers' ``ContinuousBatchingManager`` as shipped (its own thread and
  FIFO admission): ``generate_batch``;
- ``paged``: :class:`batchfleet.worker.generation.paged.PagedEngine`, the same engine
  stepped from our thread (``options.engine = "paged"``);
- ``padded``: :class:`batchfleet.worker.generation.padded.PaddedEngine`, our step loop
  over one left-padded batch (the default);
- ``generate``: ``model.generate`` one request at a time.

It checks they give the same tokens and prints output tokens/s of each.

    python bench/cb_engine.py [--prompts 32] [--new 64] [--layers 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def drive(engine: Any, prompts: list[list[int]], new: int) -> tuple[dict[str, list[int]], float]:
    """Every prompt added at once, stepped until each has ``new`` tokens; the tokens by
    sequence and the seconds it took."""
    from batchfleet.worker.generation.sampling import Sampling

    got: dict[str, list[int]] = {}
    t = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add(f"req_{i}", prompt, new, Sampling())
    while len([k for k, v in got.items() if len(v) == new]) < len(prompts):
        for o in engine.step():
            got[o.sequence] = o.tokens
    return got, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from batchfleet.worker.generation.padded import PaddedEngine
    from batchfleet.worker.generation.paged import PagedEngine
    from tiny_models import make_causal_lm
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_causal_lm(Path(tmp), layers=args.layers, hidden=args.hidden)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 200))]
               for _ in range(args.prompts)]  # fmt: skip
    n_out = args.prompts * args.new
    cb = {"num_blocks": 512, "page_size": 32, "max_batch_tokens": 512}
    rates: dict[str, float] = {}

    # transformers' manager as shipped
    gen = GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1)
    t = time.perf_counter()
    out = model.generate_batch(
        inputs=prompts, generation_config=gen,
        continuous_batching_config=ContinuousBatchingConfig(**cb, allow_block_sharing=False),
        progress_bar=False,
    )  # fmt: skip
    rates["manager (own thread, FIFO)"] = n_out / (time.perf_counter() - t)
    manager_tokens = {k: list(v.generated_tokens) for k, v in out.items()}
    model.destroy_cached_continuous_batching_manager()

    # the same engine stepped by us
    engine = PagedEngine(model, eos_token_ids=[], pad_token_id=0, kv_blocks=cb["num_blocks"],
                         page_size=cb["page_size"], step_tokens=cb["max_batch_tokens"],
                         max_running=args.prompts)  # fmt: skip
    got, seconds = drive(engine, prompts, args.new)
    rates["paged, stepped by batchfleet"] = n_out / seconds

    # batchfleet's own padded step loop (the runner's default engine)
    padded = PaddedEngine(model, eos_token_ids=[], step_tokens=cb["max_batch_tokens"],
                          max_running=args.prompts)  # fmt: skip
    own, seconds = drive(padded, prompts, args.new)
    rates["padded (batchfleet's default)"] = n_out / seconds

    # one at a time
    t = time.perf_counter()
    single = [model.generate(torch.tensor([pr]), max_new_tokens=args.new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(pr):].tolist()
              for pr in prompts[: max(4, args.prompts // 8)]]  # fmt: skip
    rates["generate, one at a time"] = len(single) * args.new / (time.perf_counter() - t)

    same = all(got[f"req_{i}"] == manager_tokens[f"req_{i}"] for i in range(args.prompts))
    same_single = all(got[f"req_{i}"] == s for i, s in enumerate(single))
    same_padded = all(own[f"req_{i}"] == s for i, s in enumerate(single))
    print(f"{args.prompts} prompts of 8-200 tokens, {args.new} new tokens each, "
          f"{args.layers} layers x {args.hidden}, {args.threads} thread(s)")  # fmt: skip
    for name, rate in rates.items():
        print(f"  {name:32s} {rate:8.1f} output tokens/s")
    print(f"  same tokens: paged == manager: {same}; paged == generate: {same_single}; "
          f"padded == generate: {same_padded}")  # fmt: skip


if __name__ == "__main__":
    main()
