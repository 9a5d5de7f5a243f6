"""The text-generation runner's per-row shortcuts on the device thread: a lone token's
text decoded once (the detokenizer's window decodes its last committed token alone every
step), and a plain stream's delta (one output, text and counts only) built without the
general path. Each gives what the general path gives."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest
from devices import DEVICE

torch = pytest.importorskip("torch")

from batchfleet.schemas.messages import Request  # noqa: E402
from batchfleet.worker.runner import Final, Partial, Prepared, Work  # noqa: E402
from batchfleet.worker.runners.generation import TextGenerationRunner  # noqa: E402
from tiny_models import make_causal_lm  # noqa: E402


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> TextGenerationRunner:
    lm = make_causal_lm(tmp_path_factory.mktemp("lm"), specials=("<x>",))
    opts: dict[str, Any] = {"kv_cache_tokens": 1024, "page_size": 16, "step_tokens": 64,
                            "max_running": 8, "engine": "padded"}  # fmt: skip
    return TextGenerationRunner(lm, device=DEVICE, dtype="float32", options=opts)


def test_a_lone_token_is_decoded_once_as_the_tokenizer_decodes_it(
    runner: TextGenerationRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: the backend's decode counted, the runner's cache empty
    backend = runner._backend_decode
    assert backend is not None
    calls: list[list[int]] = []

    def counted(ids: Any, **kw: Any) -> str:
        calls.append(list(ids))
        return backend(ids, **kw)

    monkeypatch.setattr(runner, "_backend_decode", counted)
    monkeypatch.setattr(runner, "_one_token", {})
    tok = runner.tokenizer
    ids = [*range(0, min(tok.vocab_size, 300)), *tok.all_special_ids]
    # When: each token decoded alone twice, and a window of two after its first token
    for _ in range(2):
        for t in ids:
            assert runner._decode([t]) == tok.decode([t], skip_special_tokens=True)
    pairs = [[a, b] for a, b in pairwise(ids)][:50]
    for pair in pairs:
        assert runner._decode(pair) == tok.decode(pair, skip_special_tokens=True)
    # Then: the backend decoded each lone token once, and every window of two
    assert calls == [[t] for t in dict.fromkeys(ids)] + pairs
    assert runner._decode([]) == ""


def test_a_plain_stream_s_deltas_are_its_text_and_counts(runner: TextGenerationRunner) -> None:
    """One output streamed: its first delta carries its prompt's count (the general path),
    the others only ``input``, ``text`` and ``tokens``, one a step it produced in, in the
    order made; together they are its result."""
    reqs = [Request(id="p", model="lm", inputs=["the man was"], max_new_tokens=12, stream=True),
            Request(id="q", model="lm", inputs=["a b c"], max_new_tokens=5, stream=True,
                    stop=["zzz"])]  # fmt: skip
    preps = runner.prepare_many(reqs)
    assert all(isinstance(p, Prepared) for p in preps)
    admit = tuple(zip(("p", "q"), preps, strict=True))
    chunks: dict[str, list[dict[str, Any]]] = {"p": [], "q": []}
    finals: dict[str, Final] = {}
    produced: dict[str, int] = {"p": 0, "q": 0}
    for n in range(40):
        report = runner.step(Work(f"s{n}", admit if n == 0 else ()))
        for key, k in (report.produced or {}).items():
            produced[key] += k
        for ev in report.events:
            if isinstance(ev, Partial):
                chunks[ev.key].append(ev.chunk)
            elif isinstance(ev, Final):
                finals[ev.key] = ev
        runner._settle_last()
        if len(finals) == 2:
            break
    for key in ("p", "q"):
        (out,) = finals[key].outputs
        first, *rest = chunks[key]
        assert first["prompt_tokens"] == out["prompt_tokens"]
        assert all(list(c) == ["input", "text", "tokens"] and c["input"] == 0 for c in rest)
        assert "".join(c["text"] for c in chunks[key]) == out["text"]
        assert sum(c["tokens"] for c in chunks[key]) == out["completion_tokens"] == produced[key]
        assert all(c["tokens"] > 0 or c["text"] for c in chunks[key])
