"""Redis memory per 1M pending requests, measured on a real local redis-server (docs/deploy.md).

Run: ``.venv/bin/python bench/stream_memory.py [--requests 1000000] [--chars 100 1000]``
(about a minute per million on 2 cores). For each input size it adds that many msgpack
requests, exactly as ``Producer.submit`` encodes them (uuid id, reply channel, one input
text), to one lane stream with the ``workers`` group, and reports ``used_memory`` growth:
queued (not yet read), then also pending in a consumer's PEL (read, not acked). Results
(``SET … EX`` of a 384-float embedding result) are measured on a tenth of the count.
Writes ``bench/results/stream-memory.md`` too.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

import redis
from batchfleet.producer.submit import build_request, prepare
from batchfleet.schemas.codec import encode_result
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.messages import Result, Timings

from batchfleet.redis_server import LocalRedis

CHUNK = 10_000


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def measure(r: redis.Redis, n: int, chars: int) -> dict[str, float]:
    r.flushall()
    stream = ModelKeys("minilm").lane(1)
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    reply = f"bf:reply:{uuid.uuid4().hex}"
    text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    base = used(r)
    body = 0
    for start in range(0, n, CHUNK):
        pipe = r.pipeline(transaction=False)
        for _ in range(min(CHUNK, n - start)):
            p = prepare(build_request("minilm", [text], reply=reply), 1, 3, "msgpack")
            body += sum(len(v) for v in p.fields.values())
            pipe.xadd(stream, p.fields)
        pipe.execute()
    queued = used(r) - base
    while r.xreadgroup(GROUP, "w1", {stream: ">"}, count=CHUNK):
        pass
    pending = used(r) - base
    return {"body": body / n, "queued": queued / n, "pending": pending / n}


def measure_results(r: redis.Redis, n: int) -> float:
    r.flushall()
    keys = ModelKeys("minilm")
    result = Result(id=uuid.uuid4().hex, model="minilm", status="ok", outputs=[[0.123] * 384],
                    truncated=[False], timings=Timings(queued_ms=1.0, batch_wait_ms=1.0,
                    inference_ms=20.0, total_ms=22.0, batch_size=32, batch_id="abcdef012345",
                    worker="gpu-0"), metadata={}, finished_at_ms=int(time.time() * 1000))  # fmt: skip
    payload = encode_result(result)
    base = used(r)
    for start in range(0, n, CHUNK):
        pipe = r.pipeline(transaction=False)
        for _ in range(min(CHUNK, n - start)):
            pipe.set(keys.result(uuid.uuid4().hex), payload, ex=3600)
        pipe.execute()
    return (used(r) - base) / n, len(payload)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--chars", type=int, nargs="+", default=[100, 1000])
    args = ap.parse_args(argv)
    lines = [f"Redis memory per request ({args.requests:,} requests per row, "
             f"redis-server {'{version}'}, one lane stream, msgpack)", "",
             "| input chars | entry body B | queued B/req | GiB per 1M queued "
             "| + read, pending B/req | GiB per 1M pending |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    with LocalRedis() as url:
        r = redis.Redis.from_url(url)
        version = r.info("server")["redis_version"]
        for chars in args.chars:
            started = time.monotonic()
            m = measure(r, args.requests, chars)
            print(f"{chars} chars: {m} ({time.monotonic() - started:.0f}s)", file=sys.stderr)
            lines.append(f"| {chars} | {m['body']:.0f} | {m['queued']:.0f} | "
                         f"{m['queued'] * 1e6 / 2**30:.2f} | {m['pending']:.0f} | "
                         f"{m['pending'] * 1e6 / 2**30:.2f} |")  # fmt: skip
        per_result, size = measure_results(r, max(1, args.requests // 10))
        lines += ["", f"Stored results (384-float embedding, {size} B msgpack, with TTL): "
                  f"{per_result:.0f} B each, {per_result * 1e6 / 2**30:.2f} GiB per 1M."]  # fmt: skip
        r.close()
    lines[0] = lines[0].replace("{version}", version)
    report = "\n".join(lines) + "\n"
    print(report)
    out = Path(__file__).parent / "results" / "stream-memory.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
