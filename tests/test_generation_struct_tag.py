"""vLLM's structural tags (``structured_outputs.structural_tag``, ``response_format``
``structural_tag``): the request forms and their checks, and the grammar
(``worker/generation/struct_tag.py``): free text, a structure where a trigger is written
(the trigger a special token of the tokenizer, or text), free text after it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from devices import DEVICE
from pydantic import ValidationError

torch = pytest.importorskip("torch")

from batchfleet.schemas.messages import (  # noqa: E402
    MAX_GRAMMAR_CHARS,
    Request,
    ResponseFormat,
    StructuredOutputs,
)
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_reasoning import compiled  # noqa: E402
from test_generation_runner import run  # noqa: E402
from test_generation_strict_calls import _accepts  # noqa: E402
from test_generation_tools import TIME, WEATHER  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402

TAG = {
    "type": "structural_tag",
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": TIME, "end": "</function>"},
    ],
    "triggers": ["<function="],
}
"""Qwen-style calls held mid-text (the vLLM docs' example's shape)."""
WEATHER_CALL = '<function=get_weather>{"unit": "c", "days": 2}</function>'


def test_the_tag_s_request_forms_and_checks() -> None:
    as_text = StructuredOutputs.model_validate({"structural_tag": json.dumps(TAG)})
    as_object = StructuredOutputs.model_validate({"structural_tag": TAG})
    assert as_text == as_object and as_text.kind == "structural_tag"
    fmt = ResponseFormat.model_validate({k: v for k, v in TAG.items()})
    assert fmt.structured() == as_object
    bad: list[dict[str, Any]] = [
        {"structural_tag": {**TAG, "triggers": ["<tool"]}},  # a begin with no trigger
        {"structural_tag": "{not json"},
        {"structural_tag": {**TAG, "structures": []}},
        {"structural_tag": TAG, "regex": "a+"},  # two constraints
        {"structural_tag": {**TAG, "triggers": ["<function=", "x" * 300]}},
        {"structural_tag": {**TAG, "structures": [
            {"begin": "<function=f>", "schema": {"description": "x" * MAX_GRAMMAR_CHARS}}]}},
    ]  # fmt: skip
    for body in bad:
        with pytest.raises(ValidationError):
            StructuredOutputs.model_validate(body)
    for body in ({"type": "structural_tag", "triggers": ["<f"]},
                 {"type": "json_object", "structures": TAG["structures"], "triggers": ["<f"]}):  # fmt: skip
        with pytest.raises(ValidationError):
            ResponseFormat.model_validate(body)


def _runner(tmp_path: Path, specials: tuple[str, ...] = ()) -> TextGenerationRunner:
    path = make_causal_lm(tmp_path / "m", specials=specials)
    return TextGenerationRunner(path, device=DEVICE, dtype="float32", options=TINY_LM_OPTIONS)


def _held(runner: TextGenerationRunner, **kw: Any) -> Any:
    (prep,) = runner.prepare_many([Request(id="t", model="lm", inputs=["hi"], **kw)])
    return compiled(prep)


def test_a_triggered_structure_follows_its_schema_amid_free_text(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    held = _held(runner, structured_outputs={"structural_tag": TAG})
    time = '<function=get_time>{"zone": "utc"}</function>'
    for text in ("Plain text.", "", f"Let me look. {WEATHER_CALL} and {time} Done.",
                 f"{WEATHER_CALL}{WEATHER_CALL}"):  # fmt: skip
        assert _accepts(runner, held, text), text
    for text in ('<function=get_weather>{"unit": "k", "days": 2}</function>',  # schema
                 '<function=get_moon>{"phase": 1}</function>',  # no such structure
                 '<function=get_weather>{"unit": "c", "days": 2}',  # its end left out
                 "Calling <function= now"):  # fmt: skip
        assert not _accepts(runner, held, text), text
    # the same through response_format
    fmt = _held(runner, response_format=TAG)
    assert _accepts(runner, fmt, f"ok {WEATHER_CALL}")
    assert not _accepts(runner, fmt, '<function=get_time>{"zone": "x"}</function>')


def test_a_trigger_that_is_a_special_token_is_named_as_one(tmp_path: Path) -> None:
    # the trigger and end are special tokens of this tokenizer: free text cannot write
    # them, and the structure begins with the token
    runner = _runner(tmp_path, specials=("<tool_call>", "</tool_call>"))
    compact = {**WEATHER, "x-guidance": {"whitespace_pattern": "[ ]?"}}  # (llguidance's)
    tag = {"structures": [{"begin": '<tool_call>{"name": "get_weather", "arguments": ',
                           "schema": compact, "end": "}</tool_call>"}],
           "triggers": ["<tool_call>"]}  # fmt: skip
    held = _held(runner, structured_outputs={"structural_tag": tag})
    call = '<tool_call>{"name": "get_weather", "arguments": {"unit": "f", "days": 7}}</tool_call>'
    assert _accepts(runner, held, f"Sure. {call} ok")
    assert not _accepts(runner, held, call.replace("get_weather", "get_time"))
    # a random model pushed to write the trigger writes the rest as the schema holds it
    bias = {str(runner.tokenizer.convert_tokens_to_ids("<tool_call>")): 100.0}
    for seed in range(2):
        req = Request(id=f"g{seed}", model="lm", inputs=["hi"], max_new_tokens=80, seed=seed,
                      temperature=1.0, logit_bias=bias, structured_outputs={"structural_tag": tag},
                      skip_special_tokens=False)  # fmt: skip
        (out,) = run(runner, req)[f"g{seed}"]
        head = '<tool_call>{"name": "get_weather", "arguments": '
        assert out["text"].startswith(head), out["text"]
        args, _ = json.JSONDecoder().raw_decode(out["text"][len(head) :])
        jsonschema.validate(args, WEATHER)


def test_the_grammars_compile_a_tag_on_their_own(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    grammars = runner._grammars
    assert not isinstance(grammars, str)
    constraint = grammars.compile(StructuredOutputs.model_validate({"structural_tag": TAG}))
    m = constraint.matcher()
    ids = runner.tokenizer.encode(f"x {WEATHER_CALL}", add_special_tokens=False)
    assert m.consume_tokens(ids) and m.is_accepting()
