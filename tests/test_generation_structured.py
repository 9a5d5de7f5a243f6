"""Structured outputs (``structured_outputs``: JSON schema, regex, choice, grammar)
through the runner on both engines: greedy output equals a reference loop of full
forwards masked by llguidance's own torch helpers, beside plain requests and across a
preemption; the texts follow their constraints and end ``stop``; bad constraints are
refused when the request is read, or when compiled; a constraint compiles on its own
thread while the other requests run."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")

import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402
import llguidance.torch  # noqa: E402
from batchfleet.schemas.codec import decode_entry, encode_request  # noqa: E402
from batchfleet.schemas.errors import ErrorCode  # noqa: E402
from batchfleet.schemas.messages import Request, StructuredOutputs  # noqa: E402
from batchfleet.worker.generation.grammar import Grammars, _closed  # noqa: E402
from batchfleet.worker.runner import Prepared, PrepareError  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from conftest import TINY_LM_OPTIONS  # noqa: E402
from test_generation_runner import PROMPTS, Driver, greedy, prepare, req, run  # noqa: E402


@pytest.fixture(scope="module")
def sync(tiny_lm: Path) -> TextGenerationRunner:
    """Constraints compiled when the request is read (no compile threads)."""
    return TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, "compile_threads": 0})  # fmt: skip


@pytest.fixture(params=["padded", "paged"])
def runner(tiny_lm: Path, request: pytest.FixtureRequest) -> TextGenerationRunner:
    return TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, "engine": request.param})  # fmt: skip


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def reference(runner: TextGenerationRunner, text: str, n: int, spec: dict[str, Any]) -> str:
    """Greedy under ``spec``, one full forward per token, masked by llguidance's torch
    helpers (not the code under test)."""
    lltok = llguidance.hf.from_tokenizer(runner.tokenizer, n_vocab=runner.vocab_size,
                                         eos_token=runner.eos)  # fmt: skip
    so = StructuredOutputs.model_validate(spec)
    grammar = Grammars(runner.tokenizer, runner.vocab_size, runner.eos)._grammar(so)
    matcher = llguidance.LLMatcher(lltok, grammar)
    mask = llguidance.torch.allocate_token_bitmask(1, runner.vocab_size)
    ids = runner.tokenizer(text).input_ids
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            x = torch.tensor([ids + out], device=runner.torch_device)
            logits = runner.model(x).logits[0, -1:].float().cpu()
            llguidance.torch.fill_next_token_bitmask(matcher, mask)
            llguidance.torch.apply_token_bitmask_inplace(logits, mask)
            out.append(int(logits.argmax()))
            if out[-1] in runner.eos:
                break
            assert matcher.consume_token(out[-1])
    return str(runner.tokenizer.decode(out, skip_special_tokens=True))


def test_greedy_structured_output_follows_the_reference_beside_plain_requests(
    runner: TextGenerationRunner,
) -> None:
    specs = [
        {"json": PERSON, "disable_any_whitespace": True},
        {"regex": "[0-9]{3}-[a-z]{2}"},
        {"choice": ["yes", "no", "maybe so"]},
    ]
    wanted = [reference(runner, PROMPTS[i], 40, s) for i, s in enumerate(specs)]
    assert wanted[0] != greedy(runner, PROMPTS[0], 40)
    reqs = [req(f"s{i}", inputs=[PROMPTS[i]], max_new_tokens=40, structured_outputs=s,
                stream=True) for i, s in enumerate(specs)]  # fmt: skip
    d = Driver(runner)
    preps = prepare(runner, *reqs, req("plain", inputs=[PROMPTS[3]], max_new_tokens=12))
    d.step([("s0", preps[0]), ("plain", preps[3])])
    d.step([("s1", preps[1])])  # joins while the others decode
    d.step()
    d.step([("s2", preps[2])])
    d.run()
    outs = [d.finals[f"s{i}"].outputs[0] for i in range(3)]
    assert [o["text"] for o in outs] == wanted
    assert all(o["finish_reason"] == "stop" for o in outs)
    jsonschema.validate(json.loads(outs[0]["text"]), PERSON)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", outs[1]["text"])
    assert outs[2]["text"] in ("yes", "no", "maybe so")
    assert "".join(c["text"] for c in d.partials["s0"]) == outs[0]["text"]
    assert d.finals["plain"].outputs[0]["text"] == greedy(runner, PROMPTS[3], 12)


def test_sampled_texts_all_follow_their_constraint(runner: TextGenerationRunner) -> None:
    grammar = 'root ::= "hello " name ("!" | "")\nname ::= "bob" | "alice" | [0-9]+'
    reqs = [req(f"g{i}", max_new_tokens=30, temperature=1.5, seed=i,
                structured_outputs={"grammar": grammar}) for i in range(6)]  # fmt: skip
    reqs += [req(f"j{i}", max_new_tokens=60, temperature=1.0, seed=i,
                 structured_outputs={"json": PERSON}) for i in range(3)]  # fmt: skip
    outs = run(runner, *reqs)
    texts = [outs[f"g{i}"][0]["text"] for i in range(6)]
    assert all(re.fullmatch(r"hello (bob|alice|[0-9]+)!?", t) for t in texts), texts
    assert len(set(texts)) > 1  # the draws differ
    for i in range(3):
        out = outs[f"j{i}"][0]
        if out["finish_reason"] == "stop":  # any whitespace: a draw may run to the length
            jsonschema.validate(json.loads(out["text"]), PERSON)


def test_a_seeded_constrained_request_draws_the_same_alone_and_across_preemption(
    runner: TextGenerationRunner,
) -> None:
    spec = {"json": PERSON, "disable_any_whitespace": True}
    alone = run(runner, req("a", max_new_tokens=40, temperature=1.0, seed=7,
                            structured_outputs=spec))["a"][0]["text"]  # fmt: skip
    (p,) = prepare(runner, req("b", max_new_tokens=40, temperature=1.0, seed=7,
                               structured_outputs=spec))  # fmt: skip
    (q,) = prepare(runner, req("c", inputs=PROMPTS[1:3], max_new_tokens=40))
    d = Driver(runner)
    d.step([("b", p), ("c", q)])
    for _ in range(5):
        d.step()
    d.step(preempt=["b"])
    assert "b" in d.preempted
    d.step([("b", p)])
    d.run()
    assert d.finals["b"].outputs[0]["text"] == alone
    jsonschema.validate(json.loads(alone), PERSON)


def test_a_greedy_constrained_request_preempted_resumes_to_the_same_text(
    runner: TextGenerationRunner,
) -> None:
    spec = {"regex": "[0-9]{4}-[a-z]{6}[.]"}
    wanted = reference(runner, PROMPTS[0], 20, spec)
    (p,) = prepare(runner, req("p", max_new_tokens=20, structured_outputs=spec))
    d = Driver(runner)
    d.step([("p", p)])
    for _ in range(4):
        d.step()
    d.step(preempt=["p"])
    d.step([("p", p)])
    d.run()
    assert d.finals["p"].outputs[0]["text"] == wanted


def test_a_complete_constraint_ends_the_text_even_under_min_new_tokens(
    runner: TextGenerationRunner,
) -> None:
    out = run(runner, req("m", max_new_tokens=20, min_new_tokens=10,
                          structured_outputs={"choice": ["yes"]}))["m"][0]  # fmt: skip
    assert (out["text"], out["finish_reason"]) == ("yes", "stop")


def test_n_completions_each_follow_the_constraint(runner: TextGenerationRunner) -> None:
    out = run(runner, req("n", n=4, max_new_tokens=10, temperature=2.0, seed=1,
                          structured_outputs={"choice": ["red", "green", "blue"]}))["n"]  # fmt: skip
    assert len(out) == 4 and all(o["text"] in ("red", "green", "blue") for o in out)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"regex": "[a-"}, "structured_outputs.regex"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": "[1, 2]"}, "a JSON Schema is an object"),
        ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
         "structured_outputs.json"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"grammar": "start: (("}, "structured_outputs.grammar"),
    ],
)  # fmt: skip
def test_a_constraint_llguidance_refuses_is_an_invalid_request(
    runner: TextGenerationRunner, sync: TextGenerationRunner, spec: dict[str, Any], message: str
) -> None:
    # what cannot be made a grammar is refused when read; what llguidance refuses, when
    # compiled (on its thread: the admitted request fails), or when read (no threads)
    (out,) = runner.prepare_many([req("bad", structured_outputs=spec)])
    if isinstance(out, Prepared):
        d = Driver(runner)
        d.step([("bad", out)])
        d.run()
        failed = d.failed["bad"]
        assert failed.code == ErrorCode.INVALID_REQUEST and message in failed.message
        assert not d.finals and not runner._reqs
    else:
        assert isinstance(out, PrepareError) and out.code == ErrorCode.INVALID_REQUEST
        assert message in str(out)
    (now,) = sync.prepare_many([req("bad", structured_outputs=spec)])
    assert isinstance(now, PrepareError) and now.code == ErrorCode.INVALID_REQUEST
    assert message in str(now)


def test_the_info_says_it_takes_structured_outputs(runner: TextGenerationRunner) -> None:
    assert runner.info()["structured_outputs"] is True


def test_ignore_eos_does_not_go_with_a_constraint(runner: TextGenerationRunner) -> None:
    (out,) = runner.prepare_many([req("x", ignore_eos=True, structured_outputs={"choice": ["a"]})])
    assert isinstance(out, PrepareError) and "ignore_eos" in str(out)


def test_a_schema_sent_again_is_compiled_once(runner: TextGenerationRunner) -> None:
    first, again, other = runner.prepare_many([
        req("a", structured_outputs={"json": PERSON}),
        req("b", structured_outputs={"json": json.loads(json.dumps(PERSON))}),
        req("c", structured_outputs={"json": PERSON, "disable_any_whitespace": True}),
    ])  # fmt: skip
    made = [p.payload.sampling.constraint or p.payload.compiling.result()  # type: ignore[union-attr]
            for p in (first, again, other)]  # fmt: skip
    assert made[0] is made[1] and made[2] is not made[0]


def test_disable_additional_properties_closes_every_listed_object() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
              "b": {"type": "object", "properties": {}, "additionalProperties": True}},
              "$defs": {"c": {"anyOf": [{"type": "object", "properties": {"x": {}}}]}}}  # fmt: skip
    closed = _closed(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True  # said: kept
    assert closed["$defs"]["c"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy


def test_json_object_whitespace_and_closed_properties(runner: TextGenerationRunner) -> None:
    outs = run(
        runner,
        req("o", max_new_tokens=30, structured_outputs={"json_object": True,
                                                        "disable_any_whitespace": True}),
        req("w", max_new_tokens=60, structured_outputs={
            "json": {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]},
            "whitespace_pattern": " ", "disable_additional_properties": True}),
    )  # fmt: skip
    o, w = outs["o"][0], outs["w"][0]
    assert o["text"].startswith("{") and not re.search(r"\s", o["text"][:2])
    if o["finish_reason"] == "stop":
        assert isinstance(json.loads(o["text"]), dict)
    assert w["finish_reason"] == "stop"
    assert json.loads(w["text"]) in ({"k": 1}, {"k": 2})
    assert "\n" not in w["text"]


def test_openai_s_response_format_asks_the_same(runner: TextGenerationRunner) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}  # fmt: skip
    outs = run(
        runner,
        req("vllm", max_new_tokens=40, structured_outputs={"json": PERSON}),
        req("openai", max_new_tokens=40, response_format=fmt),
        req("object", max_new_tokens=20, response_format={"type": "json_object"}),
        req("text", max_new_tokens=6, response_format={"type": "text"}),
    )  # fmt: skip
    assert outs["openai"][0]["text"] == outs["vllm"][0]["text"]
    assert outs["object"][0]["text"].startswith("{")
    assert outs["text"][0]["text"] == greedy(runner, PROMPTS[0], 6)


@pytest.mark.parametrize(
    "fmt",
    [{"type": "json_schema"}, {"type": "json_object", "json_schema": {"schema": {}}},
     {"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
     {"type": "json_schema", "json_schema": {"schema": {"d": "x" * 70_000}}}],
)  # fmt: skip
def test_response_format_is_checked(fmt: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="response_format"):
        Request(id="r", model="m", inputs=["x"], response_format=fmt)


def test_structured_outputs_and_response_format_do_not_go_together() -> None:
    with pytest.raises(ValueError, match="not both"):
        Request(id="r", model="m", inputs=["x"], response_format={"type": "json_object"},
                structured_outputs={"regex": "a"})  # fmt: skip


def test_the_wire_form_keeps_vllm_s_names() -> None:
    r = Request(id="r", model="m", inputs=["x"],
                structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True})  # fmt: skip
    for fmt in ("json", "msgpack"):
        back, _ = decode_entry(encode_request(r, fmt), "m")  # type: ignore[arg-type]
        assert back.structured_outputs == r.structured_outputs
    assert r.model_dump(exclude_none=True)["structured_outputs"] == {
        "json": {"type": "object"}, "disable_any_whitespace": True}  # fmt: skip
    assert r.generation_fields() == ["structured_outputs"]


@pytest.mark.parametrize(
    "spec",
    [{}, {"regex": "a", "choice": ["a"]}, {"json_object": False}, {"choice": []},
     {"choice": [""]}, {"regex": "x" * 70_000}, {"json": {"d": "x" * 70_000}},
     {"regex": "a", "unknown": 1}],
)  # fmt: skip
def test_the_schema_takes_exactly_one_bounded_constraint(spec: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        Request(id="r", model="m", inputs=["x"], structured_outputs=spec)


def test_a_constraint_compiles_while_the_other_requests_run(tiny_lm: Path) -> None:
    # compiles held until released (no sleeps): the plain request runs to its end, a
    # constrained one cancelled while it compiles ends at once, one preempted while it
    # compiles comes back, and once compiled it gives the reference's greedy text
    runner = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32", options=TINY_LM_OPTIONS)
    assert runner.info()["compile_threads"] == 1
    gate = threading.Event()
    real = runner._grammars._compile  # type: ignore[union-attr]

    def held(spec: StructuredOutputs) -> Any:
        assert gate.wait(60)
        return real(spec)

    runner._grammars._compile = held  # type: ignore[union-attr,method-assign]
    spec = {"json": PERSON, "disable_any_whitespace": True}
    plain, shaped, gone = prepare(runner, req("plain", max_new_tokens=6),
                                  req("shaped", max_new_tokens=40, structured_outputs=spec),
                                  req("gone", structured_outputs={"regex": "[0-9]{4}"}))  # fmt: skip
    for p in (shaped, gone):
        assert p.payload.compiling is not None and p.payload.sampling.constraint is None  # type: ignore[union-attr]
    d = Driver(runner)
    d.step([("plain", plain), ("shaped", shaped), ("gone", gone)])
    for _ in range(6):
        d.step()
    assert d.finals["plain"].outputs[0]["completion_tokens"] == 6
    assert runner.engine.state("shaped#0") is None  # not begun: still compiling
    assert d.reports[-1].compiling == 2 and not any(rep.compiled_s for rep in d.reports)
    d.step(stop=[("gone", "cancelled")], preempt=["shaped"])
    (out,) = d.finals["gone"].outputs
    assert (out["finish_reason"], out["text"]) == ("cancelled", "")
    assert "shaped" in d.preempted and not runner._compiling
    d.step([("shaped", shaped)])  # admitted again, still compiling
    assert "shaped" in runner._compiling
    gate.set()
    d.run()
    (out,) = d.finals["shaped"].outputs
    assert out["finish_reason"] == "stop" and out["text"] == reference(runner, PROMPTS[0], 40, spec)
    jsonschema.validate(json.loads(out["text"]), PERSON)
    assert not d.failed and not runner._compiling and d.reports[-1].compiling == 0
    took = [s for rep in d.reports for s in rep.compiled_s]
    assert len(took) == 2 and all(s > 0 for s in took)  # shaped's, and gone's (cancelled)
