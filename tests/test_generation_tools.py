"""Tool calling (OpenAI's ``tools`` and ``tool_choice``) on a tiny random model: the chat
template renders the tools and earlier calls; ``required`` and a named function constrain
the text so its ``tool_calls`` parse and follow the schemas; ``auto`` reads Hermes-style
calls with the model's ``tool_call_parser``, and is refused without one; each parser's
format is read whole and as it grows (streamed calls); requests that do not hold together
are refused when read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from devices import DEVICE
from pydantic import ValidationError

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")

from batchfleet.schemas.codec import decode_entry, encode_request  # noqa: E402
from batchfleet.schemas.messages import Generation, Request  # noqa: E402
from batchfleet.schemas.tools import Tool, ToolUse  # noqa: E402
from batchfleet.worker.generation import tool_blocks, tool_formats, tools  # noqa: E402
from batchfleet.worker.generation.tagged_args import param_types  # noqa: E402
from batchfleet.worker.generation.tools import PARSERS, CallReader, read_calls  # noqa: E402
from batchfleet.worker.runner import PrepareError  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_runner import (  # noqa: E402
    Driver,
    prepare,
    run,
)
from tiny_models import make_causal_lm  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1,
                                                          "maximum": 7}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}  # fmt: skip
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
CHAT = [{"role": "user", "content": "what is the weather"}]
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}call {{ c['function']['name'] }}"
    " {{ c['function']['arguments']['unit'] }}{% endfor %}"
    "{% if m.get('reasoning_content') %} thought {{ m['reasoning_content'] }}"
    " / {{ m['thinking'] }} / {{ m['reasoning'] }}{% endif %}{% if m.get('tool_call_id') %}"
    " for {{ m['tool_call_id'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template that renders the tools, earlier calls (arguments as an object), their
reasoning and the tool turns' call ids."""


@pytest.fixture(scope="module")
def runner(tiny_lm: Path) -> TextGenerationRunner:
    return TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, "tool_call_parser": "hermes"})  # fmt: skip


def chat(rid: str, **kw: Any) -> Request:
    kw.setdefault("messages", CHAT)
    kw.setdefault("tools", TOOLS)
    return Request(id=rid, model="lm", max_new_tokens=kw.pop("max_new_tokens", 60), **kw)


def test_required_makes_calls_of_the_tools_that_follow_their_schemas(
    runner: TextGenerationRunner,
) -> None:
    # a random model repeats its call until the length: "]" is pushed where it may come
    close = {str(runner.tokenizer.convert_tokens_to_ids("]")): 100.0}
    outs = run(runner, chat("req", tool_choice="required", logit_bias=close),
               chat("free", tool_choice="none", max_new_tokens=8))  # fmt: skip
    (out,) = outs["req"]
    assert out["finish_reason"] == "stop", out
    calls = out["tool_calls"]
    assert calls and len({c["id"] for c in calls}) == len(calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        fn = call["function"]
        jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
    # the text is kept as generated: vLLM's array of {name, parameters}
    made = [{"name": c["name"], "parameters": c["parameters"]} for c in json.loads(out["text"])]
    assert made == [{"name": c["function"]["name"],
                     "parameters": json.loads(c["function"]["arguments"])} for c in calls]  # fmt: skip
    assert "tool_calls" not in outs["free"][0]  # none: nothing read
    Generation.model_validate(out)  # the result's shape


def test_parallel_tool_calls_false_makes_one_call(runner: TextGenerationRunner) -> None:
    # without it the random model repeats its call until max_new_tokens (test above)
    (out,) = run(runner, chat("one", tool_choice="required", parallel_tool_calls=False))["one"]
    assert out["finish_reason"] == "stop"
    (call,) = out["tool_calls"]
    assert len(json.loads(out["text"])) == 1
    fn = call["function"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])


def test_a_named_function_is_called_with_arguments_under_its_schema(
    runner: TextGenerationRunner,
) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    (out,) = run(runner, chat("named", tool_choice=named))["named"]
    assert out["finish_reason"] == "stop"
    (call,) = out["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == json.loads(out["text"])
    jsonschema.validate(json.loads(out["text"]), TIME)


def test_auto_reads_hermes_calls_out_of_the_text(runner: TextGenerationRunner) -> None:
    # the text is forced to a Hermes call (a random model would not write one)
    markup = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "f", "days": 2}}\n</tool_call>'
    )
    outs = run(runner, chat("auto", structured_outputs={"regex": _literal(markup)}, max_new_tokens=300),
               chat("plain", max_new_tokens=10))  # fmt: skip
    (out,) = outs["auto"]
    assert out["text"] == markup
    (call,) = out["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"unit":"f","days":2}'}
    assert out["content"] == ""
    assert "tool_calls" not in outs["plain"][0]  # free text of a random model: no calls
    plain = outs["plain"][0]
    assert plain["content"] == plain["text"].strip()  # with tools, always


def test_streamed_calls_come_as_each_completes_with_the_results_ids(
    runner: TextGenerationRunner,
) -> None:
    markup = ('Checking.<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
              '<tool_call>{"name": "get_weather", "arguments": {"unit": "c", "days": 3}}'
              "</tool_call>")  # fmt: skip
    (prep,) = prepare(runner, chat("s", structured_outputs={"regex": _literal(markup)},
                                   max_new_tokens=300, stream=True))  # fmt: skip
    d = Driver(runner)
    d.step([("s", prep)])
    d.run()
    (out,) = d.finals["s"].outputs
    assert out["text"] == markup and out["content"] == "Checking."
    chunks = d.partials["s"]
    assert "".join(c["text"] for c in chunks) == markup
    # the content streams without the calls' markup, and is out before the first call ends
    assert "".join(c["content"] for c in chunks) == "Checking."
    assert not any("<" in c["content"] for c in chunks)
    streamed = [(k, call) for k, c in enumerate(chunks) for call in c.get("tool_calls", ())]
    assert [call for _, call in streamed] == out["tool_calls"]  # the same ids, in order
    assert [call["function"]["name"] for call in out["tool_calls"]] == ["get_time", "get_weather"]
    # the first call is streamed with the delta that closes its block, long before the end
    first = streamed[0][0]
    assert "".join(c["text"] for c in chunks[: first + 1]).endswith("</tool_call>")
    assert first < len(chunks) - 10
    # and as it is written (OpenAI's delta.tool_calls): its name once written, then its
    # arguments piece by piece; the pieces add up to the result's calls, same ids
    pieces = [(k, p) for k, c in enumerate(chunks) for p in c.get("tool_call_chunks", ())]
    calls: dict[int, dict[str, Any]] = {}
    for _, p in pieces:
        fn = p["function"]
        if "id" in p:
            calls[p["index"]] = {"id": p["id"], "type": p["type"],
                                 "function": {"name": fn["name"], "arguments": ""}}  # fmt: skip
        calls[p["index"]]["function"]["arguments"] += fn["arguments"]
    assert list(calls.values()) == out["tool_calls"]
    named = next(k for k, p in pieces if p["index"] == 0)
    assert "".join(c["text"] for c in chunks[: named + 1]).endswith('"get_time", "arguments": {')
    assert len([p for _, p in pieces if p["index"] == 0]) > 3  # the arguments in pieces


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> TextGenerationRunner:
    """A tiny model whose tokenizer makes ``[TOOL_CALLS]`` a special token."""
    path = make_causal_lm(tmp_path_factory.mktemp("tiny-mistral"), specials=("[TOOL_CALLS]",))
    return TextGenerationRunner(path, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, "tool_call_parser": "mistral"})  # fmt: skip


def test_a_parsers_special_token_marker_is_kept_in_the_text(
    mistral: TextGenerationRunner,
) -> None:
    tok = mistral.tokenizer
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    call = '[{"name": "get_time", "arguments": {"zone": "utc"}}]'
    # the grammar writes the special token, then the array (a random model writes neither)
    grammar = f"start: <[{marker}]> {json.dumps(call)}"
    outs = run(mistral, chat("m", structured_outputs={"grammar": grammar}, max_new_tokens=80),
               chat("none", structured_outputs={"grammar": grammar}, max_new_tokens=80,
                    tool_choice="none"))  # fmt: skip
    (out,) = outs["m"]
    assert out["text"] == "[TOOL_CALLS]" + call  # kept; the end-of-sequence token is not
    (made,) = out["tool_calls"]
    assert made["function"] == {"name": "get_time", "arguments": '{"zone":"utc"}'}
    assert outs["none"][0]["text"] == call  # no parser reads it: decoded as any text
    assert "tool_calls" not in outs["none"][0]
    # a parser whose markers this tokenizer does not make special decodes as usual
    assert mistral._keeping(("<tool_call>",)) is None


def _literal(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "".join("\\" + ch if ch in r".^$*+?()[]{}|\/" else ch for ch in text).replace(
        "\n", "\\n"
    )


def test_auto_needs_the_models_tool_call_parser(tiny_lm: Path) -> None:
    plain = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32", options=TINY_LM_OPTIONS)
    out = plain.prepare_many([chat("a"), chat("r", tool_choice="required")])
    assert isinstance(out[0], PrepareError) and "tool_call_parser" in str(out[0])
    assert not isinstance(out[1], PrepareError)
    assert plain.info()["tool_call_parser"] is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                             options={**TINY_LM_OPTIONS, "tool_call_parser": "nope"})  # fmt: skip


def test_the_chat_template_renders_tools_and_earlier_calls(runner: TextGenerationRunner) -> None:
    tok = runner.tokenizer
    template, tok.chat_template = tok.chat_template, TOOLS_TEMPLATE
    try:
        turns = [
            *CHAT,
            {"role": "assistant", "content": None, "reasoning": "cold?", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"unit": "c", "days": 1}'}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ]  # fmt: skip
        (prep,) = runner.prepare_many([chat("t", messages=turns, tool_choice="none")])
    finally:
        tok.chat_template = template
    assert not isinstance(prep, PrepareError)
    prompt = tok.decode(list(prep.payload.prompts[0]))
    assert "tools: get_weather get_time" in prompt
    assert "call get_weather c" in prompt  # the arguments as an object
    assert "sunny for call_1" in prompt
    # an earlier turn's reasoning, as Qwen3's and gpt-oss's templates read it, and as
    # vLLM gives it too (reasoning)
    assert "thought cold? / cold? / cold?" in prompt


def test_read_calls() -> None:
    required = ToolUse("required")
    text = '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{}},{"name":3}]'
    calls = read_calls(required, text, None)
    assert calls is not None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("a", '{"x":1}'), ("b", "{}")]  # fmt: skip
    assert read_calls(required, '[{"name":"a","param', None) is None  # cut by length
    (named,) = read_calls(ToolUse("named", "f"), '{"x": "é"}', None) or []
    assert named["function"] == {"name": "f", "arguments": '{"x":"é"}'}
    assert read_calls(ToolUse("named", "f"), "[1]", None) is None
    hermes = ('Let me look.<tool_call>{"name": "a", "arguments": {"q": 1}}</tool_call> and '
              '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call><tool_call>{"name": "c"')  # fmt: skip
    found = read_calls(ToolUse("auto"), hermes, "hermes") or []
    assert [c["function"]["name"] for c in found] == ["a", "b"]
    assert read_calls(ToolUse("auto"), hermes, None) is None  # no parser: nothing read
    first = read_calls(ToolUse("auto", parallel=False), hermes, "hermes") or []
    assert [c["function"]["name"] for c in first] == ["a"]
    assert read_calls(ToolUse("auto"), "no calls here", "hermes") is None


DS = tool_formats.DS
"""DeepSeek's markers (calls begin, calls end, call begin, call end, sep)."""
ST = tool_formats.STEP
"""Step-3's markers (the same order)."""
V32 = tool_formats.V32
"""DeepSeek-V3.2's DSML markers (calls begin and end, invoke's and parameter's start and end)."""
V4 = tool_formats.V4
"""DeepSeek-V4's calls' markers (its blocks are V3.2's)."""
FORMATS = {
    "hermes": ('Let me look.<tool_call>{"name": "a", "arguments": {"q": 1}}</tool_call> and '
               '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', "Let me look."),
    "llama3_json": ('<|python_tag|>{"name": "a", "parameters": {"q": 1}}; '
                    '{"name": "b", "parameters": {}}', ""),
    "mistral": ('Sure. [TOOL_CALLS][{"name": "a", "arguments": {"q": 1}}, '
                '{"name": "b", "arguments": "{}"}] ', "Sure."),
    "mistral_v11": ('[TOOL_CALLS]a[ARGS]{"q": 1}[TOOL_CALLS]b[ARGS]{}', ""),
    "pythonic": ("<|python_start|>[a(q=1), b()]<|python_end|>", ""),
    "required": ('[{"name":"a","parameters":{"q":1}},{"name":"b","parameters":{}}]', ""),
    "qwen3_coder": ("Sure.\n<tool_call>\n<function=a>\n<parameter=q>\n1\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=b>\n</function>\n"
                    "</tool_call>", "Sure."),
    "glm45": ("Sure.<tool_call>a\n<arg_key>q</arg_key>\n<arg_value>1</arg_value>\n"
              "</tool_call>\n<tool_call>b\n</tool_call>", "Sure."),
    "deepseek_v3": (f"Sure.{DS[0]}{DS[2]}function{DS[4]}a\n```json\n{{\"q\": 1}}\n```{DS[3]}\n"
                    f"{DS[2]}function{DS[4]}b\n```json\n{{}}\n```{DS[3]}{DS[1]}", "Sure."),
    "deepseek_v31": (f"{DS[0]}{DS[2]}a{DS[4]}{{\"q\": 1}}{DS[3]}{DS[2]}b{DS[4]}{{}}{DS[3]}"
                     f"{DS[1]} Done.", "Done."),  # after the section: at the end
    "kimi_k2": ("I'll check. <|tool_calls_section_begin|><|tool_call_begin|>functions.a:0"
                '<|tool_call_argument_begin|>{"q": 1}<|tool_call_end|><|tool_call_begin|>'
                "functions.b:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
                "<|tool_calls_section_end|>", "I'll check."),
    "openai": ("<|channel|>analysis<|message|>Two calls.<|end|><|start|>assistant<|channel|>"
               "commentary<|message|>On it.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.a <|constrain|>json<|message|>{"q": 1}<|call|><|start|>assistant '
               "to=functions.b<|channel|>commentary json<|message|>{}<|call|>", "On it."),
    "seed_oss": ("Sure.<seed:tool_call>\n<function=a>\n<parameter=q>\n1\n</parameter>\n"
                 "</function>\n</seed:tool_call><seed:tool_call><function=b></function>"
                 "</seed:tool_call>", "Sure."),
    "minimax_m2": ('Sure.\n<minimax:tool_call>\n<invoke name="a">\n<parameter name="q">1'
                   '</parameter>\n</invoke>\n<invoke name="b">\n</invoke>\n'
                   "</minimax:tool_call> Done.", "Sure.\n Done."),
    "internlm": ('Sure.<|action_start|><|plugin|>\n{"name": "a", "parameters": {"q": 1}}'
                 '<|action_end|>\n<|action_start|><|plugin|>{"name": "b", "parameters": {}}'
                 "<|action_end|>", "Sure."),
    "granite": ('<|tool_call|>[{"name": "a", "arguments": {"q": 1}}, {"name": "b", '
                '"arguments": {}}]', ""),
    "hunyuan_a13b": ('Sure. <tool_calls>[{"name": "a", "arguments": {"q": 1}}, {"name": "b", '
                     '"arguments": {}}]</tool_calls>', "Sure."),
    "minimax": ('Sure.\n<tool_calls>\n{"name": "a", "arguments": {"q": 1}}\n{"name": "b", '
                '"arguments": {}}\n</tool_calls> Done.', "Sure.\n Done."),
    "jamba": ('Sure. <tool_calls>[{"name": "a", "arguments": {"q": 1}}, {"name": "b", '
              '"arguments": {}}]</tool_calls>', "Sure."),
    "phi4_mini_json": ('Calling: functools[{"name": "a", "arguments": {"q": 1}}, {"name": "b", '
                       '"parameters": {}}]', "Calling:"),
    "xlam": ('[{"name": "a", "arguments": {"q": 1}}, {"name": "b", "arguments": {}}]', ""),
    "xlam_fenced": ('Sure.\n```json\n[{"name": "a", "arguments": {"q": 1}},\n {"name": "b", '
                    '"arguments": "{}"}]\n```', "Sure."),
    "xlam_marked": ('[TOOL_CALLS][{"name": "a", "arguments": {"q": 1}}, {"name": "b", '
                    '"arguments": {}}]\nDone.', "Done."),
    "xlam_tagged": ('Sure. <tool_call>[{"name": "a", "arguments": {"q": 1}}, {"name": "b", '
                    '"arguments": {}}]</tool_call> Done.', "Sure.  Done."),
    "llama4_json": ('{"name": "a", "parameters": {"q": 1}}; {"name": "b", "parameters": {}}', ""),
    "llama4_pythonic": ("<|python_start|>[a(q=1), b()]<|python_end|>", ""),
    "longcat": ('Sure.<longcat_tool_call>{"name": "a", "arguments": {"q": 1}}</longcat_tool_call>'
                '\n<longcat_tool_call>\n{"name": "b", "arguments": {}}\n</longcat_tool_call>',
                "Sure."),
    "ernie45": ('Sure.\n\n<tool_call>\n{"name": "a", "arguments": {"q": 1}}\n</tool_call>\n'
                '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n', "Sure."),
    "step3": (f'Sure.{ST[0]}{ST[2]}function{ST[4]}<steptml:invoke name="a"><steptml:parameter '
              f'name="q">1</steptml:parameter></steptml:invoke>{ST[3]}\n{ST[2]}function{ST[4]}'
              f'<steptml:invoke name="b"></steptml:invoke>{ST[3]}{ST[1]} Done.', "Sure. Done."),
    "olmo3": ("Sure.\n<function_calls>\na(q=1)\nb()\n</function_calls>\nDone.", "Sure.\n\nDone."),
    "gigachat3": ('Sure.<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "a", "arguments": '
                  '{"q": 1}}<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "b", '
                  '"arguments": {}}', "Sure."),
    "gigachat3_v31": ('Sure.<|function_call|>{"name": "a", "arguments": {"q": 1}}'
                      '<|function_call|>{"name": "b", "arguments": {}}', "Sure."),
    "deepseek_v32": (f'Sure.\n\n{V32[0]}\n{V32[2]} name="a">\n{V32[4]} name="q" string="false">1'
                     f'{V32[5]}\n{V32[3]}\n{V32[2]} name="b">\n{V32[3]}\n{V32[1]} Done.',
                     "Sure.\n\n Done."),
    "granite4": ('Sure.<tool_call>{"name": "a", "arguments": {"q": 1}}</tool_call>\n<tool_call>'
                 '{"name": "b", "arguments": {}}</tool_call>', "Sure."),
    "step3p5": ("Sure.<tool_call>\n<function=a>\n<parameter=q>\n1\n</parameter>\n</function>\n"
                "</tool_call><tool_call>\n<function=b>\n</function>\n</tool_call>", "Sure."),
    "ling3": ("Sure.<tool_call>a<arg_key>q</arg_key><arg_value>1</arg_value></tool_call>"
              "<tool_call>b</tool_call>", "Sure."),  # GLM-4.7's, no newline after the name
    "poolside_v1": ("Sure.\n<tool_call>a\n<arg_key>q</arg_key>\n<arg_value>1</arg_value>\n"
                    "</tool_call>\n<tool_call>b\n</tool_call>", "Sure."),
    "hy_v3": ("Sure.<tool_calls><tool_call>a<tool_sep><arg_key>q</arg_key><arg_value>1"
              "</arg_value></tool_call><tool_call>b<tool_sep></tool_call></tool_calls> Done.",
              "Sure. Done."),
    "solar_open2": ("Sure.<|tool_call:start|>a\n<|tool_arg:start|>q<|tool_arg:value|>1"
                    "<|tool_arg:end|>\n<|tool_call:end|><|tool_call:start|>b\n<|tool_call:end|>",
                    "Sure."),
    "lfm2": ("Sure.<|tool_call_start|>[a(q=1), b()]<|tool_call_end|> Done.", "Sure. Done."),
    "dots": ('Sure.\n<dots_function_call>\n<invoke name="a">\n<parameter name="q">1</parameter>\n'
             "</invoke>\n<invoke name=b>\n</invoke>\n</dots_function_call>", "Sure."),
    "apertus": ('Sure. <|tools_prefix|>[{"a": {"q": 1}}, {"b": {}}]<|tools_suffix|> Done.',
                "Sure.  Done."),
    "deepseek_v4": (f'Sure.\n\n{V4[0]}\n{V32[2]} name="a">\n{V32[4]} name="q" string="false">1'
                    f'{V32[5]}\n{V32[3]}\n{V32[2]} name="b">\n{V32[3]}\n{V4[1]} Done.',
                    "Sure.\n\n Done."),
    "granite-20b-fc": ('Sure. <function_call> {"name": "a", "arguments": {"q": 1}}\n'
                       '<function_call> {"name": "b", "arguments": {}}', "Sure."),
    "functiongemma": ("Sure.<start_function_call>call:a{q:<escape>1<escape>}<end_function_call>"
                      "<start_function_call>call:b{}<end_function_call> Done.", "Sure. Done."),
    "gemma4": ("Sure.<|tool_call>call:a{q:1}<tool_call|><|tool_call>call:b{}<tool_call|>",
               "Sure."),
    "dots_json": ('Sure.<dots_function_call>\n{"name": "a", "arguments": {"q": 1}}\n'
                  '</dots_function_call><dots_function_call>{"name": "b"}</dots_function_call>'
                  " Done.", "Sure. Done."),  # vLLM's fallback: a section that is JSON
    "minicpm5": ('Sure.\n<function name="a">\n<param name="q">1</param>\n</function>\n'
                 "<function name='b'><arguments></arguments></function>", "Sure."),
    "kimi_k3": ('Sure.<|open|>tools<|sep|><|open|>call tool="a" index="1"<|sep|><|open|>argument '
                'key="q" type="integer"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>'
                '<|open|>call tool="b" index="2"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>',
                "Sure."),  # (its response channel's markers: the reasoning parser's)
    "minimax_m3": ("Sure.]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name=\"a\">]<]minimax[>[<q>1"
                   "]<]minimax[>[</q>]<]minimax[>[</invoke>\n]<]minimax[>[<invoke name=\"b\">"
                   "]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call> Done.", "Sure. Done."),
}  # fmt: skip
"""A text in each format calling ``a(q=1)`` then ``b()``, and its content (a format's
variants: ``PARSER_VARIANT``)."""


def parser_of(fmt: str) -> str:
    """The parser that reads a format of :data:`FORMATS`."""
    return fmt if fmt in PARSERS else fmt.rsplit("_", 1)[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_is_read_whole_and_as_it_grows(fmt: str) -> None:
    text, content = FORMATS[fmt]
    parser = parser_of(fmt)
    use = ToolUse("required") if fmt == "required" else ToolUse("auto")
    types = {"a": {"q": "integer"}, "b": {}}  # values typed by the schema (dots: its names)
    whole = CallReader(use, parser, types)
    whole.read(text, final=True)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.calls
            ] == [("a", {"q": 1}), ("b", {})]  # fmt: skip
    assert whole.content == content
    # fed a character at a time: calls only ever added, each once, the first before the end
    growing = CallReader(use, parser, types)
    seen: list[dict[str, Any]] = []
    first_at = None
    for end in range(len(text) + 1):
        growing.read(text[:end])
        # the content streamed so far: a start of the result's, never a call's markup
        shown = growing.content_so_far(text[:end])
        assert content.startswith(shown) and not set(shown) & set("<[{")
        new = growing.unsent()
        assert not new or CallReader.may_complete(text[end - 1])  # reading then is enough
        seen += new
        assert growing.calls == seen
        if seen and first_at is None:
            first_at = end
    growing.read(text, final=True)
    seen += growing.unsent()
    assert seen == growing.calls and len(seen) == 2
    assert [c["function"] for c in seen] == [c["function"] for c in whole.calls]
    assert first_at is not None and first_at < len(text.rstrip()) - 5
    one = CallReader(ToolUse(use.kind, parallel=False), parser, types)
    one.read(text, final=True)
    assert [c["function"]["name"] for c in one.calls] == ["a"]


@pytest.mark.parametrize("parser", [*PARSERS, None])
@pytest.mark.parametrize(
    "text",
    ["I cannot <b>call</b> that.", "  [1] is a note, {x} too; <|python", "Plain, then <tool_",
     "  ", "{not a call}", "[also not]", "<|python_tag|>hello"],
)  # fmt: skip
def test_content_without_calls_streams_as_written(parser: str | None, text: str) -> None:
    # what may begin a call is held back only until it turns out not to (at the end)
    reader = CallReader(ToolUse("auto"), parser)
    shown = [reader.content_so_far(text[:end]) for end in range(len(text) + 1)]
    reader.read(text, final=True)
    assert not reader.calls and reader.content is None  # the result's content: all of it
    assert all(text.strip().startswith(s) for s in shown)
    held = text.strip()[len(shown[-1]) :]
    leads = {"llama3_json": ("{", "<|python_tag|>"), "pythonic": ("[", "<|python_start|>"),
             "xlam": ("[",)}  # fmt: skip
    leads |= {"llama4_json": leads["llama3_json"], "llama4_pythonic": leads["pythonic"]}
    if text.lstrip().startswith(leads.get(parser or "", ())):
        assert shown[-1] == ""  # a text that may be a call is all held: it would be one
    else:
        assert len(held) < len("[TOOL_CALLS]")  # at most a marker's start


def test_hermes_reads_on_from_its_last_closed_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # each read parses only the blocks closed since the last (a long text of many calls, or
    # of opening tags, would otherwise cost every step more)
    parsed: list[str] = []
    real = tool_blocks.parse_json
    monkeypatch.setattr(tool_blocks, "parse_json", lambda text: parsed.append(text) or real(text))
    block = '<tool_call>{"name": "f", "arguments": {"i": %d}}</tool_call> '
    reader = CallReader(ToolUse("auto"), "hermes")
    text = "".join(block % i for i in range(50))
    reader.read(text)
    assert len(parsed) == 50 and len(reader.calls) == 50
    reader.read(text + "<tool_call>" * 1000)
    assert len(parsed) == 50  # nothing closed since
    text += block % 50 + '<tool_call>{"name": "g", "arguments": {}}'
    reader.read(text)
    assert len(parsed) == 51 and len(reader.calls) == 51
    reader.read(text, final=True)  # the last block, cut by the end, read as the text ends
    assert len(parsed) == 52 and [c["function"]["name"] for c in reader.calls[-2:]] == ["f", "g"]


def test_qwen3_coder_values_are_typed_by_the_functions_schema() -> None:
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {
            "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
            "opts": {"type": "object"}, "ids": {"type": ["array", "null"]},
            "code": {"type": "string"}, "bad": {"type": "integer"}, "gone": {"type": "string"},
            "flag": {"type": "boolean"}}}}})  # fmt: skip
    types = param_types([tool])
    assert types == {"f": {"n": "integer", "x": "number", "ok": "boolean", "opts": "object",
                           "ids": "array", "code": "string", "bad": "integer",
                           "gone": "string", "flag": "boolean"}}  # fmt: skip
    code = 'print("a\\tb")\nx = {"k": 1}'  # a string that looks like JSON, backslashes kept
    params = {"n": "-3", "x": "2.5", "ok": "true", "opts": '{"a": [1, null]}', "ids": "[1, 2]",
              "code": code, "bad": "many", "gone": "null", "flag": "False", "extra": "7"}  # fmt: skip
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    text = f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    (call,) = read_calls(ToolUse("auto"), text, "qwen3_coder", types) or []
    assert json.loads(call["function"]["arguments"]) == {
        "n": -3, "x": 2.5, "ok": True, "opts": {"a": [1, None]}, "ids": [1, 2], "code": code,
        "bad": "many", "gone": None, "flag": False, "extra": "7"}  # fmt: skip
    cut = "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n"
    assert read_calls(ToolUse("auto"), cut, "qwen3_coder", types) is None  # its function open
    assert read_calls(ToolUse("auto"), "<tool_call>oops</tool_call>", "qwen3_coder") is None


def test_block_formats_of_deepseek_kimi_and_glm() -> None:
    auto = ToolUse("auto")
    # kimi_k2: the call's id is the model's own (its template writes it back), the name
    # without its "functions." prefix
    kimi = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3"
            '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
            "<|tool_calls_section_end|>")  # fmt: skip
    (call,) = read_calls(auto, kimi, "kimi_k2") or []
    assert call["id"] == "functions.get_weather:3"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    # glm45: values read as JSON unless the schema says string
    glm = ("<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>12</arg_value>\n"
           "<arg_key>s</arg_key>\n<arg_value>12</arg_value>\n<arg_key>o</arg_key>"
           '<arg_value>{"a": [1, null]}</arg_value><arg_key>w</arg_key><arg_value>two words'
           "</arg_value></tool_call>")  # fmt: skip
    (call,) = read_calls(auto, glm, "glm45", {"f": {"s": "string"}}) or []
    assert json.loads(call["function"]["arguments"]) == {
        "n": 12, "s": "12", "o": {"a": [1, None]}, "w": "two words"}  # fmt: skip
    # not calls: arguments that are not an object, no name, no separator, a fence left open
    for parser, text in [
        ("deepseek_v31", f"{DS[2]}f{DS[4]}[1]{DS[3]}"),
        ("deepseek_v31", f"{DS[2]}{DS[4]}{{}}{DS[3]}"),
        ("deepseek_v3", f"{DS[2]}function\nf\n```json\n{{}}\n```{DS[3]}"),
        ("deepseek_v3", f"{DS[2]}function{DS[4]}f\n```json\n{{}}{DS[3]}"),
        ("kimi_k2", "<|tool_call_begin|>f<|tool_call_argument_begin|>{}<|tool_call_end|>"),
        ("glm45", "<tool_call><arg_key>k</arg_key><arg_value>1</arg_value></tool_call>"),
    ]:
        assert read_calls(auto, text, parser) is None, (parser, text)
    # a block cut by the end is read where it parses; its section's end marker is markup
    cut = f'{DS[0]}{DS[2]}f{DS[4]}{{"x": 1}}'
    reader = CallReader(auto, "deepseek_v31")
    reader.read(cut, final=True)
    assert [c["function"]["name"] for c in reader.calls] == ["f"] and reader.content == ""


def test_xlam_reads_an_array_bare_fenced_marked_or_tagged() -> None:
    auto = ToolUse("auto")
    array = '[{"name": "a", "arguments": {"q": 1}}, {"name": "b", "arguments": "{\\"r\\": 2}"}]'
    for text, content in [
        (f"  {array}  ", ""),
        (f"Here:\n```json\n{array}\n```\nThen more.", "Here:\n\nThen more."),
        (f"Here:\n```\n{array}\n```", "Here:"),
        (f"[TOOL_CALLS]{array}\nDone.", "Done."),
        (f"Sure.<tool_call>\n{array}\n</tool_call>", "Sure."),
    ]:
        reader = CallReader(auto, "xlam")
        reader.read(text, final=True)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in reader.calls] == [("a", {"q": 1}), ("b", {"r": 2})], text  # fmt: skip
        assert reader.content == content, text
    # not calls: an array not at the start nor wrapped, a fence of code, an object (not an
    # array) in a block, entries without a name or arguments, a fence left open and cut
    for text in [
        f"Sure. {array}",
        '```python\nprint([{"name": "a"}])\n```',
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>',
        '[{"name": "a"}, {"arguments": {}}, 3]',
        '```json\n[{"name": "a", "arguments": {"q": 1',
    ]:
        assert read_calls(auto, text, "xlam") is None, text
    # a code fence before the calls, and a fence's text that looks like a marker
    text = f"See ```sh\nls [x]\n``` and:\n```json\n{array}\n```"
    assert len(read_calls(auto, text, "xlam") or []) == 2
    inner = '[{"name": "w", "arguments": {"code": "```json\\n[1]\\n```"}}]'
    (call,) = read_calls(auto, inner, "xlam") or []
    assert json.loads(call["function"]["arguments"]) == {"code": "```json\n[1]\n```"}
    # a code fence in the content streams once it cannot open calls
    reader = CallReader(auto, "xlam")
    assert reader.content_so_far("Try ```python\nx = 1") == "Try ```python\nx = 1"
    assert reader.content_so_far("Try ```js") == "Try"  # may yet be ```json
    assert reader.content_so_far("Try ```json\n") == "Try"


def test_phi4_mini_reads_the_array_after_functools() -> None:
    auto = ToolUse("auto")
    text = 'functools[{"name": "a", "parameters": {"q": [1, 2]}}, {"name": "b", "arguments": {}}]'
    calls = read_calls(auto, text, "phi4_mini_json") or []
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("a", {"q": [1, 2]}), ("b", {})]  # fmt: skip
    # the module's name in prose is not a marker, and its content is not held back
    prose = "Use functools.reduce, or import functools; functools (a module) [see docs]."
    reader = CallReader(auto, "phi4_mini_json")
    assert reader.content_so_far(prose) == prose
    assert read_calls(auto, prose, "phi4_mini_json") is None
    assert reader.content_so_far("Then functools") == "Then"  # may yet be its array
    assert read_calls(auto, '[{"name": "a", "arguments": {}}]', "phi4_mini_json") is None


def test_step3_values_are_trimmed_and_typed_by_the_functions_schema() -> None:
    def invoke(name: str, params: dict[str, str], kind: str = "function") -> str:
        body = "".join(f'<steptml:parameter name="{k}">{v}</steptml:parameter>'
                       for k, v in params.items())  # fmt: skip
        return (f'{ST[2]}{kind}{ST[4]}<steptml:invoke name="{name}">{body}</steptml:invoke>'
                f"{ST[3]}")  # fmt: skip

    types = {"f": {"n": "integer", "x": "number", "ok": "boolean", "s": "string",
                   "o": "object", "bad": "integer"}}  # fmt: skip
    params = {"n": " 3 ", "x": "2.5", "ok": "False", "s": "\n two words \n",
              "o": '{"a": [1, null]}', "bad": "many", "free": "<b>"}  # fmt: skip
    text = f"Checking.{ST[0]}{invoke('f', params)}{ST[1]}"
    reader = CallReader(ToolUse("auto"), "step3", types)
    reader.read(text, final=True)
    (call,) = reader.calls
    assert call["function"]["name"] == "f" and reader.content == "Checking."
    assert json.loads(call["function"]["arguments"]) == {
        "n": 3, "x": 2.5, "ok": False, "s": "two words", "o": {"a": [1, None]},
        "bad": "many", "free": "<b>"}  # fmt: skip
    # not calls: a type other than function, no separator, no invoke
    for bad in [invoke("f", {}, "code"), f"{ST[2]}function<steptml:invoke name=\"f\">{ST[3]}",
                f"{ST[2]}function{ST[4]}f{ST[3]}"]:  # fmt: skip
        assert read_calls(ToolUse("auto"), f"{ST[0]}{bad}{ST[1]}", "step3") is None, bad


@pytest.mark.parametrize(("alias", "parser"), list(tools.ALIASES.items()))
def test_vllms_other_names_read_their_formats(alias: str, parser: str) -> None:
    text, content = FORMATS[parser]
    reader = CallReader(ToolUse("auto"), alias)
    reader.read(text, final=True)
    same = read_calls(ToolUse("auto"), text, parser) or []
    assert [c["function"] for c in reader.calls] == [c["function"] for c in same]
    assert len(same) == 2 and reader.content == content
    assert tools.MARKERS[alias] == tools.MARKERS[parser]
    assert (alias in tools.TYPED) == (parser in tools.TYPED)  # the runner gives it the types


def test_longcat_reads_its_own_blocks_only() -> None:
    auto = ToolUse("auto")
    hermes, _ = FORMATS["hermes"]
    assert read_calls(auto, hermes, "longcat") is None
    bad = ('<longcat_tool_call>{"name": "a", "arguments": 3}</longcat_tool_call>'
           '<longcat_tool_call>{"name": "b", "arguments": {}}</longcat_tool_call>')  # fmt: skip
    reader = CallReader(auto, "longcat")
    reader.read(bad, final=True)
    assert [c["function"]["name"] for c in reader.calls] == ["b"]


def _names_args(calls: list[dict[str, Any]] | None) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls or []]


def test_olmo3_reads_a_call_a_line_in_its_block() -> None:
    auto = ToolUse("auto")
    # vLLM's cases: Python or JSON literals, escapes, no arguments, empty containers
    lines = ["register_user(name='John Doe', age=37, address={'city': 'SF'}, role=None, "
             "passed_test=True, aliases=['John', 'Johnny'])",
             "register_user(name='Jo', role=null, passed_test=true, ok=false)",
             r"""get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')""",
             "get_time()", "do_something_cool(additional_data={}, steps=[])"]  # fmt: skip
    text = "I will call.\n<function_calls>\n" + "\n\n".join(lines) + "\n</function_calls>\nOk."
    reader = CallReader(auto, "olmo3")
    reader.read(text, final=True)
    assert _names_args(reader.calls) == [
        ("register_user", {"name": "John Doe", "age": 37, "address": {"city": "SF"},
                           "role": None, "passed_test": True, "aliases": ["John", "Johnny"]}),
        ("register_user", {"name": "Jo", "role": None, "passed_test": True, "ok": False}),
        ("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'}),
        ("get_time", {}), ("do_something_cool", {"additional_data": {}, "steps": []})]  # fmt: skip
    assert reader.content == "I will call.\n\nOk."
    # not calls (the text stays content): no block, a block not closed, a line that is not
    # a call, a value that is not a literal or not finite, brackets that do not match
    for bad in ["How can I help you today?", "get_weather(city='SF')",
                "<function_calls>get_time()", "<function_calls>\n</function_calls>",
                "<function_calls>get_time()\nhello world</function_calls>",
                "<function_calls>f(x=b'z')\nget_time()</function_calls>",
                "<function_calls>calc(x=1e999)</function_calls>",
                "<function_calls>f(x=open('a'))</function_calls>",
                "<function_calls>foo(x=1])</function_calls>"]:  # fmt: skip
        got = CallReader(auto, "olmo3")
        got.read(bad, final=True)
        assert got.calls == [] and got.content is None, bad
    # the first block only (vLLM's); what may begin one is held back from the content
    two = "<function_calls>a()</function_calls> then <function_calls>b()</function_calls>"
    assert [c["function"]["name"] for c in read_calls(auto, two, "olmo3") or []] == ["a"]
    assert reader.content_so_far("I will call.\n<function_c") == "I will call."


def test_gigachat3_reads_the_json_call_after_either_header() -> None:
    auto = ToolUse("auto")
    args = {"action": "create", "content": {"short_answers": True, "english_ui": False}}
    call = json.dumps({"name": "manage_user_memory", "arguments": args}, ensure_ascii=False)
    for head in ("<|message_sep|>\n\nfunction call<|role_sep|>\n", "<|function_call|>"):
        for before in ("", "I'll check that for you."):
            reader = CallReader(auto, "gigachat3")
            reader.read(before + head + call, final=True)
            assert _names_args(reader.calls) == [("manage_user_memory", args)]
            assert reader.content == before
        empty = head + '{"name": "f", "arguments": {}}'
        assert _names_args(read_calls(auto, empty, "gigachat3")) == [("f", {})]
    # not calls: no header, not JSON, arguments not an object, no name, cut by the end
    for bad in [call, 'function call {"name": "f", "arguments": {}}',
                '<|function_call|>{"name": "f", "arguments": {"a": tru}}',
                '<|function_call|>{"name": "f", "arguments": [1]}',
                '<|function_call|>{"arguments": {}}', '<|function_call|>{"name": "f", "argu']:  # fmt: skip
        assert read_calls(auto, bad, "gigachat3") is None, bad
    # the content before a header is out before the call; "function call" in prose too
    reader = CallReader(auto, "gigachat3")
    assert reader.content_so_far("Sure.<|message_sep|>\n\nfunction call") == "Sure."
    assert reader.content_so_far("A function call") == "A"  # may yet be the header
    assert reader.content_so_far("A function call is a call.") == "A function call is a call."


def _dsml(name: str, params: dict[str, tuple[str, str]]) -> str:
    """A DSML invoke of ``name``, each parameter's value and ``string`` attribute."""
    body = "".join(f'{V32[4]} name="{k}" string="{s}">{v}{V32[5]}\n'
                   for k, (v, s) in params.items())  # fmt: skip
    return f'{V32[2]} name="{name}">\n{body}{V32[3]}\n'


def test_deepseek_v32_values_are_typed_as_vllm_does() -> None:
    types = {"f": {"enabled": "boolean", "count": "integer", "ratio": "number", "tags": "array",
                   "meta": "object", "name": "string", "n": "integer"}}  # fmt: skip
    params = {"enabled": ("true", "false"), "count": ("42", "false"), "ratio": ("3.14", "false"),
              "tags": ('["a", "b"]', "false"), "meta": ('{"k": 1}', "false"),
              "name": ("007", "false"), "n": ("42", "true"), "loc": (" 杭州 ", "true"),
              "free": ('{"x": [1, null]}', "false"), "word": ("two words", "false")}  # fmt: skip
    text = f"Sure, let me check! {V32[0]}\n{_dsml('f', params)}{_dsml('g', {})}{V32[1]}"
    reader = CallReader(ToolUse("auto"), "deepseek_v32", types)
    reader.read(text, final=True)
    assert _names_args(reader.calls) == [("f", {
        "enabled": True, "count": 42, "ratio": 3.14, "tags": ["a", "b"], "meta": {"k": 1},
        "name": "007", "n": "42", "loc": " 杭州 ", "free": {"x": [1, None]},
        "word": "two words"}), ("g", {})]  # fmt: skip
    assert reader.content == "Sure, let me check!"
    # a parameter without its string attribute is not read; an invoke without a name is no
    # call, nor one not closed while the text may grow
    loose = f'{V32[2]} name="f">{V32[4]} name="a">1{V32[5]}{V32[3]}'
    assert _names_args(read_calls(ToolUse("auto"), loose, "deepseek_v32")) == [("f", {})]
    assert read_calls(ToolUse("auto"), f"{V32[2]}>{V32[3]}", "deepseek_v32") is None
    reader = CallReader(ToolUse("auto"), "deepseek_v32")
    reader.read(f'{V32[0]}{V32[2]} name="f">')
    assert reader.calls == []


def test_auto_reads_qwen3_coder_calls_typed_by_the_tools(tiny_lm: Path) -> None:
    coder = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                 options={**TINY_LM_OPTIONS, "tool_call_parser": "qwen3_coder"})  # fmt: skip
    markup = ("<tool_call>\n<function=get_weather>\n<parameter=unit>\nf\n</parameter>\n"
              "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
    (out,) = run(coder, chat("x", structured_outputs={"regex": _literal(markup)},
                             max_new_tokens=300))["x"]  # fmt: skip
    assert out["text"] == markup and out["content"] == ""
    (call,) = out["tool_calls"]  # days an integer (its schema's type), unit (an enum) text
    assert call["function"] == {"name": "get_weather", "arguments": '{"unit":"f","days":2}'}


def test_parsers_read_only_their_own_format() -> None:
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder",
                            "glm45", "deepseek_v3", "deepseek_v31", "kimi_k2", "openai",
                            "seed_oss", "minimax_m2", "internlm", "granite", "hunyuan_a13b",
                            "minimax", "phi4_mini_json", "xlam", "longcat", "step3", "jamba",
                            "llama4_json", "llama4_pythonic", "ernie45", "olmo3", "gigachat3",
                            "qwen3_xml", "deepseek_v32", "granite4", "step3p5", "ling3",
                            "poolside_v1", "mimo", "hy_v3", "solar_open2", "lfm2",
                            "apertus", "dots", "deepseek_v4", "granite-20b-fc",
                            "functiongemma", "gemma4", "cohere_command3",
                            "cohere_command4", "glm47", "minicpm5", "kimi_k3", "minimax_m3",
                            "hy_v4", "inkling", "muse_glimmer"}  # fmt: skip
    auto = ToolUse("auto")
    pythonic = ('[get_weather(city="SF", days=-2, opts={"a": [1, true, None], "b": (2.5,)}),'
                " ns.f()]")  # fmt: skip
    calls = read_calls(auto, pythonic, "pythonic") or []
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "SF", "days": -2, "opts": {"a": [1, True, None], "b": [2.5]}}),
        ("ns.f", {})]  # fmt: skip
    for text in [
        '[f(x=__import__("os").getcwd())]',
        "[f(1)]",
        "f(x=1)",
        "[f(**k)]",
        "[f(x=1)] and then]",
        "[f(x=b'1')]",
        "[f(x=1e999)]",
        "[" * 300 + "]" * 300,
    ]:
        assert read_calls(auto, text, "pythonic") is None, text
    assert read_calls(auto, 'I think {"name": "a", "parameters": {}}', "llama3_json") is None
    assert read_calls(auto, '{"name": "a", "parameters": 3}', "llama3_json") is None
    assert read_calls(auto, '[{"name": "a", "arguments": {}}]', "mistral") is None  # no marker
    assert read_calls(auto, '[TOOL_CALLS][{"name": "a", "arguments": {"x": [1', "mistral") is None
    deep = '<tool_call>{"name": "a", "arguments": ' + "[" * 100_000 + "</tool_call>"
    assert read_calls(auto, deep, "hermes") is None
    # with the text cut: hermes takes a last block that parses, others what closed
    cut = '<tool_call>{"name": "a", "arguments": {}}'
    assert [c["function"]["name"] for c in read_calls(auto, cut, "hermes") or []] == ["a"]
    reader = CallReader(auto, "hermes")
    reader.read(cut)
    assert reader.calls == []  # not while the text may still grow


BAD = [
    ({"inputs": ["x"], "tools": TOOLS}, "chat"),
    ({"tool_choice": "required", "tools": None}, "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of"),
    ({"tools": TOOLS + TOOLS[:1]}, "unique"),
    ({"tools": []}, "1 to 128"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "pattern"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "constrains"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "structured_outputs": {"regex": "a"}}, "constrains"),
    ({"messages": [{"role": "assistant", "content": None}]}, "null only"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "why"), BAD)
def test_requests_that_do_not_hold_together_are_refused(fields: dict[str, Any], why: str) -> None:
    body = {"id": "r", "model": "lm", "messages": CHAT, "tools": TOOLS, **fields}
    if "inputs" in body:
        del body["messages"]
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ValidationError, match=why):
        Request.model_validate(body)


def test_tools_on_the_wire_and_to_an_encoder() -> None:
    req = chat("w", tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for fmt in ("msgpack", "json"):
        back, _ = decode_entry(encode_request(req, fmt), "lm")  # type: ignore[arg-type]
        assert back == req and back.tool_use == ToolUse("named", "get_weather", False)
    assert set(req.generation_fields()) >= {"tools", "tool_choice"}  # encoders refuse them
