"""The gateway's translations, without a server: OpenAI fields → submit options (checked by
the producer's own request validation), results → answers, deltas → stream chunks
(restarts included), batchfleet errors → HTTP errors."""

from __future__ import annotations

import json as _json
from typing import Any

import pytest
from batchfleet.producer.core import GENERATION_OPTIONS
from batchfleet.producer.gateway import handler
from batchfleet.producer.gateway.answers import chat_response, completion_response
from batchfleet.producer.gateway.anthropic_fields import submission as anthropic_submission
from batchfleet.producer.gateway.chunks import Chunks, Diverged
from batchfleet.producer.gateway.endpoint import Answered, Submission
from batchfleet.producer.gateway.errors import ApiError, of_exception, of_result
from batchfleet.producer.gateway.openai_fields import chat_submission, completion_submission
from batchfleet.producer.gateway.response_input import response_submission
from batchfleet.producer.submit import build_request
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.errors import QueueFull, RequestRejected, ResultTimeout, Unavailable
from batchfleet.schemas.messages import Delta, Result

ANSWERED = Answered("x-1", 1700000000)
NOT_GENERATION = {"messages", "inputs", "priority", "deadline_ms"}


def built(sub: Submission) -> Any:
    """The request the producer would build from a submission (its validation applies)."""
    options = sub.options
    assert set(options) - set(GENERATION_OPTIONS) <= NOT_GENERATION
    return build_request(sub.model, options.get("inputs"), messages=options.get("messages"),
                         generation={k: options.get(k) for k in GENERATION_OPTIONS},
                         deadline_ms=options.get("deadline_ms"))  # fmt: skip


def test_chat_fields_become_the_fleets() -> None:
    body = {
        "model": "lm", "max_tokens": 9, "max_completion_tokens": 12, "temperature": 0.5,
        "top_p": 0.9, "n": 2, "stop": "END", "seed": 3, "logprobs": True, "top_logprobs": 4,
        "presence_penalty": 0.5, "logit_bias": {"17": -100}, "user": "u1", "store": False,
        "min_tokens": 2, "top_k": 5, "priority": 0, "deadline_ms": 5000,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "messages": [
            {"role": "developer", "content": "be kind"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "assistant", "content": "x", "reasoning": "hmm"},
        ],
    }  # fmt: skip
    sub = chat_submission(body)
    request = built(sub)
    assert request.max_new_tokens == 12 and request.min_new_tokens == 2
    assert request.stop == ["END"] and request.logprobs == 4 and request.n == 2
    assert request.logit_bias == {"17": -100.0} and request.top_k == 5
    assert request.parallel_tool_calls is False and request.deadline_ms == 5000
    assert sub.options["priority"] == 0
    msgs = request.messages
    assert msgs is not None and msgs[0].role == "system"
    # text parts kept as parts: the model's chat_template_content_format joins them or not
    assert [(p.type, p.text) for p in msgs[1].content or ()] == [("text", "a"), ("text", "b")]
    assert msgs[2].tool_calls is not None and msgs[4].reasoning_content == "hmm"
    # one part goes as its text (as workers before parts take it)
    one = chat_submission(body | {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}]}]})  # fmt: skip
    assert one.options["messages"][0]["content"] == "a"


def test_a_chat_s_template_goes_to_the_worker() -> None:
    # vLLM's chat_template: the worker renders it where the model trusts request templates
    body = {"model": "lm", "messages": [{"role": "user", "content": "x"}],
            "chat_template": "{{ messages[0]['content'] }}"}  # fmt: skip
    assert built(chat_submission(body)).chat_template == "{{ messages[0]['content'] }}"


def test_guided_fields_and_their_refusals() -> None:
    base = {"model": "lm", "messages": [{"role": "user", "content": "x"}]}
    sub = chat_submission(base | {"guided_choice": ["a", "b"]})
    assert built(sub).structured_outputs.choice == ["a", "b"]
    regex = chat_submission(base | {"guided_regex": "[0-9]+"})
    assert built(regex).structured_outputs.regex == "[0-9]+"
    with pytest.raises(ApiError, match="one constraint"):
        chat_submission(base | {"guided_regex": "a", "structured_outputs": {"regex": "b"}})
    for bad, param in ((base | {"messages": []}, "messages"), ({"messages": [1]}, "model"),
                       (base | {"messages": ["hi"]}, "messages[0]")):  # fmt: skip
        with pytest.raises(ApiError) as e:
            chat_submission(bad)
        assert e.value.status == 400 and e.value.param == param
    with pytest.raises(ApiError, match="image_url") as e:
        chat_submission(base | {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]})  # fmt: skip
    assert e.value.param == "messages[0].content"


def test_completion_prompts() -> None:
    for prompt, inputs in (("a", ["a"]), (["a", "b"], ["a", "b"]),
                           ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]])):  # fmt: skip
        request = built(completion_submission({"model": "lm", "prompt": prompt, "logprobs": 2}))
        got = [i if isinstance(i, str) else i.prompt_token_ids for i in request.inputs]
        assert got == inputs and request.logprobs == 2
    for body, word in (({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt"),
                       ({"prompt": "a", "suffix": "z"}, "suffix"),
                       ({"prompt": "a", "best_of": 3}, "best_of"),
                       ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
                       ({"prompt": "a", "add_special_tokens": 1}, "add_special_tokens")):  # fmt: skip
        with pytest.raises(ApiError) as e:
            completion_submission({"model": "lm", **body})
        assert e.value.param == word


def test_beam_search_fields_map_to_the_fleets_and_are_not_streamed() -> None:
    beam = {"use_beam_search": True, "n": 3, "length_penalty": 0.5, "max_tokens": 8}
    chat = {"model": "lm", "messages": [{"role": "user", "content": "x"}]} | beam
    for sub in (
        chat_submission(chat),
        completion_submission({"model": "lm", "prompt": "x"} | beam),
    ):
        request = built(sub)
        assert request.use_beam_search and request.n == 3 and request.length_penalty == 0.5
    with pytest.raises(ApiError) as e:
        completion_submission({"model": "lm", "prompt": "x", "stream": True} | beam)
    assert e.value.status == 400 and e.value.param == "use_beam_search"
    with pytest.raises(RequestRejected, match="top_p"):  # the fleet's own check
        built(chat_submission(chat | {"top_p": 0.8}))
    hot = built(chat_submission(chat | {"temperature": 0.8, "seed": 4}))  # each round's draw
    assert hot.use_beam_search and hot.temperature == 0.8 and hot.seed == 4
    assert built(chat_submission(chat | {"use_beam_search": False, "length_penalty": None})).n == 3


def test_thinking_token_budget_reaches_the_fleet_from_each_route() -> None:
    # vLLM's extra field, under its own name, on chat completions, completions and (as a
    # chat's extra) the Responses API
    budget = {"thinking_token_budget": 0}
    chat = {"model": "lm", "messages": [{"role": "user", "content": "x"}]}
    for sub in (
        chat_submission(chat | budget),
        completion_submission({"model": "lm", "prompt": "x"} | budget),
        response_submission({"model": "lm", "input": "x"} | budget),
        anthropic_submission({"model": "lm", "max_tokens": 8, **chat} | budget),
    ):
        assert built(sub).thinking_token_budget == 0
    # Anthropic's budget_tokens, a soft target clients send routinely, is not one
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 4096}
    assert built(anthropic_submission(chat | thinking)).thinking_token_budget is None
    # -1 is vLLM's "no budget"; below that, the fleet's own check names the field
    assert (
        built(chat_submission(chat | {"thinking_token_budget": -1})).thinking_token_budget is None
    )
    with pytest.raises(RequestRejected) as e:
        built(chat_submission(chat | {"thinking_token_budget": -2}))
    assert e.value.param == "thinking_token_budget"


def test_echo_with_logprobs_asks_the_prompts_score_and_max_tokens_0_only_with_echo() -> None:
    # lm-evaluation-harness's loglikelihood: echo, logprobs, max_tokens 0
    body = {"model": "lm", "prompt": "the cat", "echo": True, "logprobs": 1, "max_tokens": 0}
    request = built(completion_submission(body))
    assert (request.max_new_tokens, request.logprobs, request.prompt_logprobs) == (0, 1, 1)
    assert built(completion_submission(body | {"prompt_logprobs": 3})).prompt_logprobs == 3
    assert completion_submission(body | {"echo": False, "max_tokens": 1}).options.get(
        "prompt_logprobs") is None  # fmt: skip
    # token ids echo as the worker decodes them; text prompts as sent
    ids = completion_submission({"model": "lm", "prompt": [[1, 2], [3]], "echo": True})
    assert ids.options["return_prompt_text"] is True
    assert "return_prompt_text" not in completion_submission(body).options
    # a streamed echo goes on, of text prompts and token ids, with logprobs or not
    assert completion_submission(body | {"logprobs": None, "stream": True}).options["stream"]
    streamed = built(completion_submission(body | {"prompt": [1, 2], "stream": True}))
    assert (streamed.stream, streamed.prompt_logprobs, streamed.return_prompt_text) == (
        True, 1, True)  # fmt: skip
    # the chat routes take no max_tokens 0 (vLLM's refusal)
    chat = {"model": "lm", "messages": [{"role": "user", "content": "x"}]}
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(ApiError) as e:
            chat_submission(chat | {field: 0})
        assert (e.value.status, e.value.param) == (400, field)


def test_echoed_prompt_scores_lead_the_logprobs() -> None:
    def lp(token: int, text: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "text": text, "logprob": logprob,
                "top": [{"token": 0, "text": "a", "logprob": -0.25}]}  # fmt: skip

    prompt_lps = [None, lp(7, " cat", -2.0), lp(8, " sat", float("-inf"))]
    res = result([{"text": "!", "finish_reason": "stop", "stop_reason": "!",
                   "logprobs": [lp(9, "!", -0.5)], "prompt_logprobs": prompt_lps},
                  {"text": "?", "finish_reason": "length", "logprobs": [lp(10, "?", -1.0)]}])  # fmt: skip
    out = completion_response({"prompt": "the cat sat", "n": 2, "echo": True, "logprobs": 1},
                              res, ANSWERED)  # fmt: skip
    a, b = out["choices"]
    assert (a["text"], b["text"]) == ("the cat sat!", "the cat sat?")
    # the first prompt token's text is what precedes the rest; its score null, as vLLM's
    assert a["logprobs"] == {
        "tokens": ["the", " cat", " sat", "!"],
        "token_logprobs": [None, -2.0, -9999.0, -0.5],
        "top_logprobs": [None, {" cat": -2.0, "a": -0.25}, {" sat": -9999.0, "a": -0.25},
                         {"!": -0.5, "a": -0.25}],
        "text_offset": [0, 3, 7, 11],
    }  # fmt: skip
    # the input's second output: the same prompt (its first output's scores), its own text
    assert b["logprobs"]["tokens"] == ["the", " cat", " sat", "?"]
    assert (a["stop_reason"], b["stop_reason"]) == ("!", None)
    # max_tokens 0: the prompt alone; a BOS the text does not show reads as ""
    zero = result([{"text": "", "finish_reason": "length", "prompt_text": "<s>the cat",
                    "prompt_logprobs": [None, lp(5, "the", -1.5), lp(7, " cat", -2.0)]}])  # fmt: skip
    (c,) = completion_response({"prompt": [1, 5, 7], "echo": True, "logprobs": 0}, zero,
                               ANSWERED)["choices"]  # fmt: skip
    assert c["text"] == "<s>the cat" and c["logprobs"]["tokens"] == ["<s>", "the", " cat"]
    plain = completion_response({"prompt": "the cat", "echo": True, "logprobs": 0}, zero,
                                ANSWERED)["choices"][0]  # fmt: skip
    assert plain["text"] == "the cat" and plain["logprobs"]["tokens"] == ["", "the", " cat"]
    assert plain["logprobs"]["text_offset"] == [0, 0, 3]
    # a worker that did not score the prompt: the generated tokens, offset past the echo
    old = result([{"text": "!", "finish_reason": "stop", "logprobs": [lp(9, "!", -0.5)]}])
    (d,) = completion_response({"prompt": "ab", "echo": True, "logprobs": 0}, old,
                               ANSWERED)["choices"]  # fmt: skip
    assert d["logprobs"]["tokens"] == ["!"] and d["logprobs"]["text_offset"] == [2]


def result(outputs: list[dict[str, Any]], **more: Any) -> Result:
    return Result.model_validate({"id": "r1", "model": "lm", "status": "ok",
                                  "outputs": outputs, **more})  # fmt: skip


def test_chat_answer() -> None:
    lp = {"token": 5, "text": "hi", "logprob": -0.5,
          "top": [{"token": 5, "text": "hi", "logprob": -0.5}]}  # fmt: skip
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    res = result([
        {"text": "<tool_call>...", "finish_reason": "stop", "content": "", "tool_calls": [call]},
        {"text": "hi", "finish_reason": "length", "logprobs": [lp],
         "reasoning_content": "think"},
    ], usage={"prompt_tokens": 7, "completion_tokens": 3,
              "prompt_tokens_details": {"cached_tokens": 4}})  # fmt: skip
    out = chat_response({}, res, ANSWERED)
    first, second = out["choices"]
    assert first["stop_reason"] is None
    stopped = result([{"text": "a", "finish_reason": "stop", "stop_reason": "END"}])
    assert chat_response({}, stopped, ANSWERED)["choices"][0]["stop_reason"] == "END"
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    assert first["message"]["tool_calls"] == [call]
    assert second["message"] == {"role": "assistant", "content": "hi", "tool_calls": [],
                                 "reasoning_content": "think", "reasoning": "think"}  # fmt: skip
    assert second["logprobs"]["content"][0] == {
        "token": "hi", "logprob": -0.5, "bytes": [104, 105],
        "top_logprobs": [{"token": "hi", "logprob": -0.5, "bytes": [104, 105]}]}  # fmt: skip
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                            "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    assert out["id"] == "x-1" and out["object"] == "chat.completion"


def test_legacy_top_logprobs_hold_the_token_itself_as_openai_and_vllm() -> None:
    # Given a sampled token outside the 2 likeliest, and one that is the likeliest
    def lp(token: int, text: str, logprob: float, top: list[tuple[int, str, float]]) -> Any:
        return {"token": token, "text": text, "logprob": logprob,
                "top": [{"token": i, "text": t, "logprob": x} for i, t, x in top]}  # fmt: skip

    tops = [(1, " a", -0.5), (2, " b", -1.0)]
    lps = [lp(9, " z", -3.0, tops), lp(1, " a", -0.5, tops)]
    res = result([{"text": " z a", "finish_reason": "length", "logprobs": lps}])
    # When answered as a completion with logprobs 2, and as a chat with top_logprobs 2
    legacy = completion_response({"prompt": "P", "logprobs": 2}, res, ANSWERED)
    chat = chat_response({"messages": [], "logprobs": True, "top_logprobs": 2}, res, ANSWERED)
    # Then each position's top_logprobs leads with its own token (up to logprobs + 1,
    # OpenAI's rule for the legacy shape, which vLLM keeps), never twice
    assert legacy["choices"][0]["logprobs"]["top_logprobs"] == [
        {" z": -3.0, " a": -0.5, " b": -1.0}, {" a": -0.5, " b": -1.0}]  # fmt: skip
    assert list(legacy["choices"][0]["logprobs"]["top_logprobs"][0]) == [" z", " a", " b"]
    # and a chat's are the likeliest alone, as OpenAI's chat answers them
    content = chat["choices"][0]["logprobs"]["content"]
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == [[" a", " b"]] * 2


def test_tokens_as_token_ids_whole_and_streamed() -> None:
    # Given generated tokens, one not whole UTF-8 (its text U+FFFD), and a scored echo
    def lp(token: int, text: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "text": text, "logprob": logprob,
                "top": [{"token": 3, "text": " a", "logprob": -0.25}]}  # fmt: skip

    lps = [lp(9, "\ufffd", -1.0), lp(3, " a", -0.25)]
    res = result([{"text": "\ufffd a", "finish_reason": "length", "logprobs": lps,
                   "prompt_logprobs": [None, lp(7, " cat", -2.0)], "prompt_token_ids": [5, 7]}])  # fmt: skip
    ids = {"return_tokens_as_token_ids": True}
    # When a chat asks its tokens as ids
    chat = chat_response({"logprobs": True, "top_logprobs": 1} | ids, res, ANSWERED)
    # Then each token reads token_id:{id}; the generated token's bytes stay its text's, an
    # alternative's are its token's (vLLM's)
    first = chat["choices"][0]["logprobs"]["content"][0]
    assert first == {"token": "token_id:9", "logprob": -1.0, "bytes": [239, 191, 189],
                     "top_logprobs": [{"token": "token_id:3", "logprob": -0.25,
                                       "bytes": list(b"token_id:3")}]}  # fmt: skip
    assert chat_response({"logprobs": True}, res, ANSWERED)["choices"][0]["logprobs"][
        "content"][0]["token"] == "\ufffd"  # fmt: skip
    # and a completion's tokens and top_logprobs' keys too, the echoed prompt's first
    # by its id, offsets still into the text
    text = completion_response({"prompt": "the cat", "echo": True, "logprobs": 1} | ids, res,
                               ANSWERED)["choices"][0]  # fmt: skip
    assert text["text"] == "the cat\ufffd a"
    assert text["logprobs"]["tokens"] == ["token_id:5", "token_id:7", "token_id:9", "token_id:3"]
    assert text["logprobs"]["top_logprobs"][1:] == [
        {"token_id:7": -2.0, "token_id:3": -0.25}, {"token_id:9": -1.0, "token_id:3": -0.25},
        {"token_id:3": -0.25}]  # fmt: skip
    assert text["logprobs"]["text_offset"] == [0, 3, 7, 8]
    # (the gateway asks the prompt's ids for it, and shows them only where asked)
    echo = {"model": "lm", "prompt": "the cat", "echo": True, "logprobs": 1}
    assert built(completion_submission(echo | ids)).return_token_ids
    assert not built(completion_submission(echo)).return_token_ids
    assert "prompt_token_ids" not in text
    shown = completion_response(echo | ids | {"return_token_ids": True}, res, ANSWERED)
    assert shown["choices"][0]["prompt_token_ids"] == [5, 7]
    # and streamed, chat and completion alike
    c = Chunks({"logprobs": True} | ids, ANSWERED, "lm", chat=True)
    streamed = c.feed(delta(1, "\ufffd", logprobs=[lps[0]]))[-1]["choices"][0]["logprobs"]
    assert streamed["content"][0]["token"] == "token_id:9"
    t = Chunks({"prompt": "P", "logprobs": 1} | ids, ANSWERED, "lm", chat=False)
    (chunk,) = t.feed(delta(1, "\ufffd", logprobs=[lps[0]]))
    assert chunk["choices"][0]["logprobs"]["tokens"] == ["token_id:9"]
    (chunk,) = t.feed(delta(2, " a", logprobs=[lps[1]]))
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [1]
    # a streamed echo's ids (asked by the gateway) shown only where the client asked them
    for asked in (False, True):
        e = Chunks(echo | ids | {"return_token_ids": asked}, ANSWERED, "lm", chat=False)
        sent = e.feed(delta(1, "!", logprobs=[lps[0]], token_ids=[9], prompt_tokens=2,
                            prompt_token_ids=[5, 7], prompt_logprobs=res.generations()[0]
                            .prompt_logprobs))  # fmt: skip
        assert sent[0]["choices"][0]["logprobs"]["tokens"][0] == "token_id:5"
        assert [("token_ids" in c["choices"][0]) for c in sent] == [False, asked]


def test_vllm_fields_the_fleet_does_not_take_are_refused_by_name() -> None:
    chat = {"model": "lm", "messages": [{"role": "user", "content": "x"}]}
    text = {"model": "lm", "prompt": "x"}
    refused = {"prompt_embeds": "AAAA", "logprob_token_ids": [1],
               "include_reasoning": False, "watermarking": True,
               "spaces_between_special_tokens": False, "truncation_side": "right",
               "documents": [{"text": "d"}],
               "media_io_kwargs": {}, "mm_processor_kwargs": {"a": 1},
               "routed_experts_prompt_start": 2, "kv_transfer_params": {},
               "ec_transfer_params": {}, "vllm_xargs": {"a": 1},
               "repetition_detection": {"max_pattern_size": 2}}  # fmt: skip
    for name, value in refused.items():
        for make, body in ((chat_submission, chat), (completion_submission, text)):
            with pytest.raises(ApiError) as e:
                make(body | {name: value})
            assert e.value.status == 400 and e.value.param == name
            assert f"{name} is not supported" in str(e.value)
    with pytest.raises(ApiError, match="pickle") as e:
        completion_submission(text | {"prompt_embeds": ["AAAA"]})
    with pytest.raises(ApiError) as e:
        chat_submission(chat | {"echo": True})
    assert e.value.param == "echo"
    # their values that change nothing (and null) are taken, as the default they are
    plain = {"thinking_token_budget": -1, "include_reasoning": True, "watermarking": False,
             "spaces_between_special_tokens": True, "truncation_side": "left",
             "routed_experts_prompt_start": 0, "prompt_embeds": None, "echo": False,
             "return_tokens_as_token_ids": True, "session_id": "s", "stream_interval": 4}  # fmt: skip
    assert built(chat_submission(chat | plain)).messages
    assert built(completion_submission(text | plain | {"echo": None})).inputs == ["x"]
    with pytest.raises(ApiError) as e:  # a truthy 1 is not false
        chat_submission(chat | {"watermarking": 0})
    with pytest.raises(ApiError) as e:
        chat_submission(chat | {"return_tokens_as_token_ids": "yes"})
    assert e.value.param == "return_tokens_as_token_ids"


def test_a_chat_returns_its_rendered_prompt_as_vllm() -> None:
    chat = {"model": "lm", "messages": [{"role": "user", "content": "x"}],
            "return_prompt_text": True}  # fmt: skip
    assert built(chat_submission(chat)).return_prompt_text
    res = result([{"text": "hi", "finish_reason": "stop", "prompt_text": "<u>x</u>"}])
    assert chat_response(chat, res, ANSWERED)["prompt_text"] == "<u>x</u>"
    assert "prompt_text" not in chat_response(
        chat, result([{"text": "hi", "finish_reason": "stop"}]), ANSWERED
    )
    c = Chunks(chat | {"stream": True}, ANSWERED, "lm", chat=True)
    opening, more = c.feed(delta(1, "hi", prompt_text="<u>x</u>", prompt_tokens=3))
    assert opening["prompt_text"] == "<u>x</u>" and "prompt_text" not in more
    late = Chunks(chat, ANSWERED, "lm", chat=True).finish(res)  # nothing streamed before
    assert late[0]["prompt_text"] == "<u>x</u>"


def test_completion_answer_echo_offsets_and_prompt_logprobs() -> None:
    tok = [{"token": i, "text": t, "logprob": -1.0, "top": []} for i, t in enumerate("ab")]
    prompt_lps = [None, {"token": 9, "text": "q", "logprob": -2.0,
                         "top": [{"token": 3, "text": "z", "logprob": -0.1},
                                 {"token": 9, "text": "q", "logprob": -2.0}]}]  # fmt: skip
    res = result([{"text": "ab", "finish_reason": "stop", "logprobs": tok,
                   "prompt_logprobs": prompt_lps},
                  {"text": "c", "finish_reason": "stop"}])  # fmt: skip
    out = completion_response({"prompt": "P", "n": 2, "echo": True}, res, ANSWERED)
    a, b = out["choices"]
    assert (a["text"], b["text"]) == ("Pab", "Pc")
    assert a["logprobs"] is None  # the body asked none (vLLM's prompt_logprobs alone)
    plain = completion_response({"prompt": "P", "n": 2}, res, ANSWERED)["choices"][0]
    assert plain["logprobs"]["text_offset"] == [0, 1] and plain["logprobs"]["tokens"] == ["a", "b"]
    assert a["prompt_logprobs"] == [None, {
        "9": {"logprob": -2.0, "rank": 2, "decoded_token": "q"},
        "3": {"logprob": -0.1, "rank": 1, "decoded_token": "z"}}]  # fmt: skip
    # a prompt token outside the likeliest: its rank as the worker sends it (old workers: none)
    outside = {"token": 9, "text": "q", "logprob": -7.0, "top": prompt_lps[1]["top"][:1]}
    for sent, rank in (({"rank": 57}, 57), ({}, None)):
        res = result([{"text": "", "finish_reason": "length",
                       "prompt_logprobs": [None, outside | sent]}])  # fmt: skip
        scored = completion_response({"prompt": "P"}, res, ANSWERED)["choices"][0]
        assert scored["prompt_logprobs"][1] == {
            "9": {"logprob": -7.0, "rank": rank, "decoded_token": "q"},
            "3": {"logprob": -0.1, "rank": 1, "decoded_token": "z"}}  # fmt: skip


def delta(seq: int, text: str, index: int = 0, **more: Any) -> Delta:
    return Delta(id="r1", seq=seq, input=index, text=text, tokens=1, **more)


def test_chunks_chat_stream_and_a_restart() -> None:
    c = Chunks({"stream_options": {"include_usage": True}}, ANSWERED, "lm", chat=True)
    first = c.feed(delta(1, "Hel"))
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first[1]["choices"][0]["delta"] == {"content": "Hel"} and first[1]["usage"] is None
    assert c.feed(delta(2, "lo")) and c.feed(delta(3, "x", index=1))
    # Restarted: the same deltas again are skipped, then new ones go on
    assert c.feed(Restarted("r1")) == []
    assert c.feed(delta(1, "Hel")) == [] and c.feed(delta(2, "lo")) == []
    assert c.feed(delta(3, "x", index=1)) == []
    (more,) = c.feed(delta(4, "!"))
    assert more["choices"][0]["delta"] == {"content": "!"}
    # and a regeneration that differs from what was sent ends the stream
    c.feed(Restarted("r1"))
    with pytest.raises(Diverged):
        c.feed(delta(1, "Help"))
    end = c.finish(result([{"text": "Hello!", "finish_reason": "stop"},
                           {"text": "x", "finish_reason": "length"}],
                          usage={"prompt_tokens": 2, "completion_tokens": 5}))  # fmt: skip
    assert [e["choices"][0]["finish_reason"] for e in end[:2]] == ["stop", "length"]
    assert [e["choices"][0]["stop_reason"] for e in end[:2]] == [None, None]
    assert end[-1]["choices"] == [] and end[-1]["usage"]["total_tokens"] == 7
    # what ended a stop output (vLLM's stop_reason): a stop string or a stop token id
    for reason in ("END", 2):
        stopped = Chunks({}, ANSWERED, "lm", chat=True).finish(result([{
            "text": "a", "finish_reason": "stop", "stop_reason": reason}]))  # fmt: skip
        assert stopped[-1]["choices"][0]["stop_reason"] == reason


def test_chunks_continuous_usage_stats_count_each_choice_as_it_goes() -> None:
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk holds
    # its choice's prompt (its first delta tells it) and the tokens sent so far
    opts = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    c = Chunks(opts, ANSWERED, "lm", chat=True)
    role, text = c.feed(delta(1, "Hel", prompt_tokens=6))
    assert role["usage"] == {"prompt_tokens": 6, "completion_tokens": 0, "total_tokens": 6}
    assert text["usage"] == {"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7}
    (_, other) = c.feed(delta(2, "x", index=1, prompt_tokens=9))
    assert other["usage"] == {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
    (more,) = c.feed(delta(3, "lo"))
    assert more["usage"]["completion_tokens"] == 2
    # a restart's replayed deltas count once
    c.feed(Restarted("r1"))
    assert c.feed(delta(1, "Hel", prompt_tokens=6)) == [] and c.feed(delta(2, "x", index=1)) == []
    assert c.feed(delta(3, "lo")) == []
    (last,) = c.feed(delta(4, "!"))
    assert last["usage"]["completion_tokens"] == 3
    # the ends hold each choice's result, the last chunk the whole usage
    end = c.finish(result([{"text": "Hello!", "finish_reason": "stop", "prompt_tokens": 6,
                            "completion_tokens": 4},
                           {"text": "x", "finish_reason": "length", "prompt_tokens": 9,
                            "completion_tokens": 1}],
                          usage={"prompt_tokens": 15, "completion_tokens": 5}))  # fmt: skip
    assert [e["usage"]["completion_tokens"] for e in end[:2]] == [4, 1]
    assert end[-1]["choices"] == [] and end[-1]["usage"]["total_tokens"] == 20
    # without include_usage, no usage at all (as vLLM)
    plain = Chunks({"stream_options": {"continuous_usage_stats": True}}, ANSWERED, "lm", True)
    assert all("usage" not in chunk for chunk in plain.feed(delta(1, "a", prompt_tokens=3)))


def test_chunks_before_anything_sent_a_restart_changes_nothing() -> None:
    c = Chunks({}, ANSWERED, "lm", chat=True)
    assert c.feed(Restarted("r1")) == []
    assert len(c.feed(delta(1, "other"))) == 2  # role, then the text


def test_chunks_completion_echo_and_tool_chunks() -> None:
    c = Chunks({"prompt": ["P", "Q"], "n": 2, "echo": True}, ANSWERED, "lm", chat=False)
    out = c.feed(delta(1, "a", index=3))
    assert [o["choices"][0]["text"] for o in out] == ["Q", "a"]
    # a choice that streamed nothing still opens (its echo) before its end
    end = c.finish(result([{"text": "", "finish_reason": "stop"}] * 4))
    texts = [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in end]
    assert texts[:2] == [(0, "P"), (0, "")] and ("Q" not in [t for i, t in texts if i == 3])
    chat = Chunks({}, ANSWERED, "lm", chat=True)
    chunk = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    out = chat.feed(delta(1, "<tool_call>", content="", tool_call_chunks=[chunk]))
    assert out[-1]["choices"][0]["delta"] == {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": ""}}]}  # fmt: skip


def test_errors() -> None:
    failed = Result.model_validate({"id": "r", "model": "lm", "status": "error",
                                    "error": {"code": "too_large", "message": "big"}})  # fmt: skip
    assert (of_result(failed).status, of_result(failed).code) == (400, "too_large")
    expired = Result.model_validate({"id": "r", "model": "lm", "status": "expired",
                                     "error": {"code": "deadline_exceeded", "message": "late"}})  # fmt: skip
    assert of_result(expired).status == 504
    unknown = Result.model_validate({"id": "r", "model": "lm", "status": "error", "error": {
        "code": "brand_new", "message": "?"}}, context={"from_wire": True})  # fmt: skip
    assert of_result(unknown).status == 500 and of_result(unknown).code == "brand_new"
    assert of_exception(QueueFull("full")).status == 429
    assert of_exception(Unavailable("down")).status == 503
    assert of_exception(ResultTimeout("slow")).status == 504
    assert of_exception(RequestRejected("bad")).body()["error"] == {
        "message": "bad", "type": "invalid_request_error", "param": None,
        "code": "invalid_request"}  # fmt: skip


def test_redis_unreachable_mid_request_is_a_503() -> None:
    import asyncio

    from batchfleet.producer.aio import AsyncProducer
    from batchfleet.producer.gateway.app import Gateway, make_app

    from batchfleet.redis_server import free_port

    async def go() -> list[tuple[int, Any]]:
        dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
        async with AsyncProducer(dead, retry_for_s=0.1) as producer:
            port = free_port()
            server = make_app(Gateway(producer), {}).listen(port, "127.0.0.1")
            out = []
            for method, path, body in (("GET", "/v1/models", b""),
                                       ("POST", "/v1/chat/completions", _json.dumps(
                                           {"model": "m", "messages": [{"role": "user",
                                                                         "content": "x"}]}
                                       ).encode()),
                                       ("GET", "/health", b"")):  # fmt: skip
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(f"{method} {path} HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n"
                             .encode() + body)  # fmt: skip
                raw = await reader.read()
                writer.close()
                head, _, payload = raw.partition(b"\r\n\r\n")
                out.append((int(head.split()[1]), _json.loads(payload)["error"]["code"]))
            server.stop()
            return out

    assert asyncio.run(go()) == [(503, "unavailable")] * 3


def test_add_special_tokens_goes_to_the_fleet_only_where_not_the_default() -> None:
    text = {"model": "lm", "prompt": "a"}
    chat = {"model": "lm", "messages": [{"role": "user", "content": "x"}]}
    assert "add_special_tokens" not in completion_submission(text).options
    assert "add_special_tokens" not in completion_submission(
        text | {"add_special_tokens": True}).options  # fmt: skip
    assert (
        built(completion_submission(text | {"add_special_tokens": False})).add_special_tokens
        is False
    )
    assert "add_special_tokens" not in chat_submission(chat | {"add_special_tokens": False}).options
    assert built(chat_submission(chat | {"add_special_tokens": True})).add_special_tokens is True
    with pytest.raises(ApiError) as e:
        chat_submission(chat | {"add_special_tokens": "yes"})
    assert (e.value.status, e.value.param) == (400, "add_special_tokens")


def _lp(token: int, text: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "text": text, "logprob": logprob,
            "top": [{"token": token, "text": text, "logprob": logprob}]}  # fmt: skip


ECHO_RESULT = result([
    {"text": " on it", "finish_reason": "length", "prompt_text": "the cat",
     "logprobs": [_lp(4, " on", -1.0), _lp(5, " it", -2.0)],
     "prompt_logprobs": [None, _lp(2, " cat", -3.0)]},
    {"text": " ran", "finish_reason": "stop", "logprobs": [_lp(6, " ran", -0.5)]},
    {"text": "!", "finish_reason": "length", "prompt_text": "<s>a dog",
     "logprobs": [_lp(7, "!", -0.25)],
     "prompt_logprobs": [None, _lp(8, "a", -1.5), _lp(9, " dog", -2.5)]},
    {"text": "", "finish_reason": "stop", "logprobs": []},
], usage={"prompt_tokens": 5, "completion_tokens": 4})  # fmt: skip
"""Two inputs (a text, token ids), n 2: what a worker answers echo with logprobs 1."""


def echo_deltas(prompt_info: bool) -> list[Delta]:
    """``ECHO_RESULT`` as its deltas, in an order a worker may send them (an input's second
    output first); ``prompt_info``: the first delta of each input's first output carries
    its prompt's text and log-probabilities (a worker that knows them)."""
    outs = ECHO_RESULT.generations()

    def d(seq: int, i: int, k: int, first: bool) -> Delta:
        g = outs[i]
        lps = g.logprobs[k : k + 1] if g.logprobs else []
        more: dict[str, Any] = {"prompt_tokens": 2} if first else {}
        if first and prompt_info and i % 2 == 0:
            more |= {"prompt_text": g.prompt_text, "prompt_logprobs": g.prompt_logprobs}
        text = "".join(t.text for t in lps)
        return Delta(id="r1", seq=seq, input=i, text=text, tokens=1, logprobs=lps, **more)

    return [d(1, 1, 0, True), d(2, 0, 0, True), d(3, 2, 0, True), d(4, 0, 1, False),
            d(5, 3, 0, True)]  # fmt: skip


@pytest.mark.parametrize("prompt_info", [True, False], ids=["worker-tells", "older-worker"])
@pytest.mark.parametrize("max_tokens", [2, 0])
@pytest.mark.parametrize("ids", [True, False], ids=["token-ids", "texts"])
def test_a_streamed_echo_adds_up_to_the_whole_answer(
    prompt_info: bool, max_tokens: int, ids: bool
) -> None:
    prompt = [[1, 2], [1, 8, 9]] if ids else ["the cat", "a dog"]
    body = {"prompt": prompt, "n": 2, "echo": True, "logprobs": 1, "max_tokens": max_tokens}
    whole = completion_response(body, ECHO_RESULT, ANSWERED)["choices"]
    if max_tokens == 0:  # the prompt only: no delta, the result tells all
        res = result([{**g, "text": "", "logprobs": []} for g in ECHO_RESULT.outputs or []])
        whole, deltas = completion_response(body, res, ANSWERED)["choices"], []
    else:
        res, deltas = ECHO_RESULT, echo_deltas(prompt_info)
    c = Chunks(body | {"stream": True}, ANSWERED, "lm", chat=False)
    sent: list[list[dict[str, Any]]] = [c.feed(d) for d in deltas]
    sent.append(c.finish(res))
    chunks = [ch for out in sent for o in out for ch in o["choices"]]
    for w in whole:
        mine = [ch for ch in chunks if ch["index"] == w["index"]]
        assert "".join(ch["text"] for ch in mine) == w["text"]
        lps = [ch["logprobs"] for ch in mine if ch["logprobs"] is not None]
        assert {k: [x for lp in lps for x in lp[k]] for k in w["logprobs"]} == w["logprobs"]
        echo = "the cat" if w["index"] < 2 else "<s>a dog" if ids else "a dog"
        assert mine[0]["text"] == echo and w["text"].startswith(echo)  # the echo first
        assert mine[-1]["finish_reason"] == w["finish_reason"]
    if max_tokens and prompt_info:
        # the prompt's echo leads as soon as the first delta of its input tells it
        assert [ch["index"] for ch in (o["choices"][0] for o in sent[1])] == [0, 1, 1, 0]
        assert sent[1][0]["choices"][0]["logprobs"]["tokens"] == ["the", " cat"]
    elif max_tokens:  # an older worker's deltas do not tell: held until the result
        assert all(out == [] for out in sent[:-1])


@pytest.mark.parametrize(("chat", "echo"), [(True, False), (False, False), (False, True)],
                         ids=["chat", "completion", "completion-echo"])  # fmt: skip
@pytest.mark.parametrize("worker_tells", [True, False], ids=["worker-tells", "older-worker"])
def test_streamed_prompt_token_ids_lead_each_choice_as_whole(
    chat: bool, worker_tells: bool, echo: bool
) -> None:
    """vLLM's ``return_token_ids``: each choice's first chunk carries its prompt's ids (a
    chat's on the chunk, a completion's in the choice), token ids add up to the whole's."""
    prompts = [[5]] if chat else [[1, 2], [1, 8, 9]]
    body: dict[str, Any] = {"n": 2, "return_token_ids": True, "echo": echo}
    body |= {"messages": []} if chat else {"prompt": ["the cat", "a dog"]}
    outputs = [{"text": f"t{k}", "finish_reason": "stop", "token_ids": [k, k + 1],
                "prompt_tokens": len(prompts[k // 2]), "completion_tokens": 2}
               | ({"prompt_token_ids": prompts[k // 2]} if k % 2 == 0 else {})
               for k in range(2 * len(prompts))]  # fmt: skip
    res = result(outputs)
    whole = (chat_response if chat else completion_response)(body, res, ANSWERED)
    # Given the deltas: each output's first (its prompt's ids where the worker tells them),
    # one with no text yet (part of a character) but a token, then the rest
    deltas, seq = [], 0
    for k, out in enumerate(outputs):
        ids = prompts[k // 2] if worker_tells else None
        for j, text in enumerate(("", out["text"])):
            seq += 1
            deltas.append(delta(seq, text, index=k, token_ids=[out["token_ids"][j]],
                                **({"prompt_token_ids": ids} if j == 0 else {})))  # fmt: skip
    c = Chunks(body | {"stream": True}, ANSWERED, "lm", chat=chat)
    sent = [ch for d in deltas for ch in c.feed(d)] + c.finish(res)
    for k in range(len(outputs)):
        mine = [ch for ch in sent if ch["choices"] and ch["choices"][0]["index"] == k]
        holders = [ch if chat else ch["choices"][0] for ch in mine]
        with_ids = [i for i, h in enumerate(holders) if "prompt_token_ids" in h]
        # Then one chunk of each choice carries its prompt's ids: its first where the worker
        # told them, else its last (the result tells)
        assert with_ids == [0 if worker_tells else len(mine) - 1], k
        assert holders[with_ids[0]]["prompt_token_ids"] == prompts[k // 2]
        ids = [t for ch in mine for t in ch["choices"][0].get("token_ids", [])]
        expected = whole["choices"][k]["token_ids"]
        assert ids == expected  # none lost with a chunk that shows no text
    if chat:
        assert whole["prompt_token_ids"] == prompts[0]
    else:  # the whole answer gives every choice its prompt's (vLLM's)
        assert [ch["prompt_token_ids"] for ch in whole["choices"]] == [
            prompts[k // 2] for k in range(len(outputs))
        ]
    # without return_token_ids, none anywhere
    plain = Chunks(body | {"return_token_ids": None}, ANSWERED, "lm", chat=chat)
    quiet = [ch for d in deltas for ch in plain.feed(d)] + plain.finish(res)
    assert not any("prompt_token_ids" in ch or any("prompt_token_ids" in x for x in ch["choices"])
                   for ch in quiet)  # fmt: skip


def rejected_param(body: dict[str, Any], chat: bool = True) -> str | None:
    """The ``param`` of the 400 the fleet's own validation of ``body`` answers with."""
    sub = (chat_submission if chat else completion_submission)(body)
    with pytest.raises(RequestRejected) as e:
        built(sub)
    error = of_exception(e.value, body)
    assert error.status == 400
    return error.param


def test_the_fleets_own_refusals_name_the_field_as_the_route_does() -> None:
    chat = {"model": "lm", "messages": [{"role": "user", "content": "x"}]}
    text = {"model": "lm", "prompt": "x"}
    assert rejected_param(chat | {"temperature": -1}) == "temperature"
    assert rejected_param(text | {"top_p": 2}, chat=False) == "top_p"
    # batchfleet's max_new_tokens is the name the client sent
    assert rejected_param(chat | {"max_tokens": -3}) == "max_tokens"
    assert rejected_param(chat | {"max_completion_tokens": -3}) == "max_completion_tokens"
    assert rejected_param(text | {"max_tokens": -3}, chat=False) == "max_tokens"
    assert rejected_param(chat | {"min_tokens": -1}) == "min_tokens"
    assert rejected_param(chat | {"logprobs": True, "top_logprobs": 10**6}) == "top_logprobs"
    assert rejected_param(text | {"logprobs": 10**6}, chat=False) == "logprobs"
    assert rejected_param({**chat, "messages": [{"role": "user"}]}) == "messages[0]"
    # a check of the whole request names the field its message begins with
    beam = {"use_beam_search": True, "max_tokens": 4}
    assert rejected_param(chat | beam | {"top_k": 8}) == "use_beam_search"
    assert rejected_param(chat | {"length_penalty": 0.5}) == "length_penalty"
    assert rejected_param(chat | {"stop_token_ids": [-1]}) == "stop_token_ids"
    assert rejected_param(chat | {"continue_final_message": True}) == "continue_final_message"
    # ...and none where it names none
    assert rejected_param({**chat, "stop": ["x"] * 1000}) is None
    # the Responses API's and a prompt's names
    for param, body, name in (
        ("max_new_tokens", {"max_output_tokens": -1}, "max_output_tokens"),
        ("inputs[1]", {"prompt": ["a", ""]}, "prompt[1]"),
        ("messages[0].content", {"input": []}, "input[0].content"),
    ):
        assert of_exception(RequestRejected("bad", param=param), body).param == name


@pytest.mark.parametrize("made_once", [True, False], ids=["c-encoder", "fallback"])
def test_answers_are_compact_utf8_json_as_json_dumps_writes_them(
    made_once: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given each way dumps encodes (its C encoder made once; an encode a call, where the
    # Python has no C encoder)
    if not made_once:
        monkeypatch.setattr(handler, "_C_ENCODE", None)
    tricky = {"text": ' "q" café\n\t\u2028\x00 {json} 😀', "n": [1, -2.5, 1e-7, 1e300, None],
              "ok": True, "no": False, "nested": {"": [], "k": {}}, "nan": float("nan")}  # fmt: skip
    assert handler.dumps(tricky) == _json.dumps(tricky, ensure_ascii=False, separators=(",", ":"))
    assert handler.dumps("alone") == '"alone"'
    with pytest.raises(TypeError, match="not JSON serializable"):
        handler.dumps({"x": object()})
