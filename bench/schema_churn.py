"""``python -m bench.schema_churn``: a saturated fleet decoding while requests bring JSON
schemas it has not compiled yet, compiled on the loop thread (``compile_threads = 0``,
as before) against on a thread of their own (1), in alternating rounds.

The model is the generation benchmark's tiny Llama shape (4 layers, hidden 256) with
SmolLM2's tokenizer (49,152 tokens), so that each schema costs what it costs for a real
vocabulary (llguidance compiles against every token). Plain requests (the generation
benchmark's mixed trace) saturate the worker; every ``--every``-th request instead
carries a schema of its own (an ``anyOf`` of ``--objects`` objects of 40 enum
properties: about 27 ms to compile on this machine) and asks 16 tokens. Compared: the
plain requests' gaps between deltas (p50, p99), fleet tokens/s, the device thread's idle
gaps between steps, and the schema requests' time to first token. One torch thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from batchfleet.redis_server import LocalRedis

from . import generation as g


def schema(k: int, objects: int) -> dict[str, Any]:
    """Request ``k``'s own schema (its property names make it one no other request has)."""

    def one(i: int) -> dict[str, Any]:
        return {"type": "object", "required": [f"p0_{k}_{i}"],
                "properties": {f"p{j}_{k}_{i}": {"type": "string", "enum": [f"v{v}" for v in range(5)]}
                               for j in range(40)}}  # fmt: skip

    return {"anyOf": [one(i) for i in range(objects)]}


def churn_model(workdir: Path) -> Path:
    """The tiny Llama shape with SmolLM2's tokenizer and vocabulary, random weights."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(g.smollm2_dir(), gguf_file=g.SMOLLM2_GGUF)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    out = workdir / "churn-lm"
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.schema_churn",
                                description=__doc__.splitlines()[0])  # fmt: skip
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--rate", type=float, default=30.0, help="arrivals per second")
    p.add_argument("--every", type=int, default=6, help="every n-th request brings a schema")
    p.add_argument("--objects", type=int, default=24)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows: list[str] = []
    with LocalRedis() as url, tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
        work = Path(tmp)
        path = churn_model(work)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        jobs = g.workload(lambda s: list(tok(s)["input_ids"]), lambda ids: str(tok.decode(ids)),
                          args.requests, args.seed, prompt_tokens=(8, args.max_prompt),
                          new_tokens=(8, args.max_new))  # fmt: skip
        shaped = {j.index for j in jobs if j.index % args.every == args.every - 1}
        jobs = [dataclasses.replace(j, max_new=16, extra=(("structured_outputs", {
                    "json": schema(j.index, args.objects), "disable_any_whitespace": True}),))
                if j.index in shaped else j for j in jobs]  # fmt: skip
        options = {"kv_cache_tokens": 32768, "page_size": 32, "step_tokens": 512,
                   "max_running": 64}  # fmt: skip
        for r in range(args.rounds):
            for threads in (0, 1) if r % 2 == 0 else (1, 0):
                model = g.GenModel("churn", path, {**options, "compile_threads": threads})
                fleet = g.Fleet(model, url, work, args.threads, tag=f"-r{r}-c{threads}")
                fleet.start()
                try:
                    out = fleet.run(jobs, args.rate, f"compile_threads={threads}", drain_s=180)
                finally:
                    fleet.stop()
                rows.append(_row(r, threads, out, shaped))
                print(rows[-1], flush=True)
    table = [
        f"Schema churn: {args.requests} requests at {args.rate:g}/s, every {args.every}th with "
        f"its own schema ({args.objects} objects), tiny Llama shape with SmolLM2's tokenizer, "
        f"{args.threads} torch thread(s).",
        "",
        "| round | compile_threads | tokens/s | plain delta gap p50 / p99 ms | device idle "
        "between steps (gaps < 50 ms): total s, p99 ms | schema TTFT p50 ms | failed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    print("\n".join(table))
    if args.out is not None:
        args.out.write_text("\n".join(table) + "\n")
    return 0


def _row(r: int, threads: int, out: g.Outcome, shaped: set[int]) -> str:
    gaps = [x for k, gs in enumerate(out.extra["delta gaps ms"]) if k not in shaped for x in gs]
    parts: g.StepParts = out.extra["step parts"]
    ttft = [t for t, j in zip(out.ttft_ms(), [j for j in out.jobs if out.first[j.index] is not None
                                               and out.start[j.index] is not None], strict=True)
            if j.index in shaped]  # fmt: skip
    failed = sum(1 for f in out.finish if f not in ("stop", "length"))
    idle = sum(parts.gap_ms) / 1e3
    return (
        f"| {r + 1} | {threads} | {out.tokens_per_s:,.1f} | {g._p(gaps, 50):.1f} / "
        f"{g._p(gaps, 99):.1f} | {idle:.2f}, {g._p(parts.gap_ms, 99):.1f} | "
        f"{statistics.median(ttft) if ttft else float('nan'):.0f} | {failed} |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
