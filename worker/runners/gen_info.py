"""What the text-generation runner publishes about itself: its model info (engine,
budgets, parsers, adapters, sampling defaults) with the engine's counters, and each
step's speculation counts.
"""

from __future__ import annotations

from typing import Any

from ..runner import StepReport
from .gen_controls import Controls


class Info(Controls):
    """Model info and engine counters."""

    def info(self) -> dict[str, Any]:
        return {
            "runner": self.name, "engine": self.engine_kind, "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "matmul_precision": self.matmul_precision, "context": self.context,
            "kv_cache_tokens": self.kv_cache_tokens, "page_size": self.page_size,
            "kv_cache_dtype": str(self.kv_cache_dtype).removeprefix("torch."),
            "step_tokens": self.step_tokens, "max_running": self.max_running,
            "compile_threads": self.compile_threads,
            "decode": "lean" if getattr(self.engine, "lean", None) is not None else "transformers",
            "running": len(self._reqs),
            "structured_outputs": not isinstance(self._grammars, str),
            "tool_call_parser": self.tool_call_parser,
            "reasoning_parser": self.reasoning_parser,
            "reasoning_markers": None if self._markers is None
            else [self._markers.start_str, self._markers.end_str],
            "lora_adapters": list(self.lora_adapters), "max_loras": self.max_loras,
            "sampling_defaults": self.sampling_defaults.sampling,
            **self._resident(),
        }  # fmt: skip

    def _resident(self) -> dict[str, Any]:
        """The padded engine's prompt tokens run and taken from a twin's prefill (a
        request's ``n`` completions); with a prefix cache, the tokens it holds and those
        prompts found there; on CPU, tokens its KV rows hold written, bytes released. The
        paged engine's prompt tokens taken from shared blocks."""
        from ..generation.draft import DraftProposer
        from ..generation.padded import PaddedEngine
        from ..generation.paged import PagedEngine

        e = self.engine
        if isinstance(e, PagedEngine):  # its shared blocks' hits
            return {"prefix_cache_hit_tokens": e.sharing.hit_tokens} if e.sharing.on else {}
        if not isinstance(e, PaddedEngine):
            return {}
        out: dict[str, Any] = {"prefill_tokens": e.prefilled, "prefill_shared_tokens": e.shared}
        if e.speculative is not None:
            if isinstance(draft := e.speculative, DraftProposer):
                out.update(draft_kv_tokens=draft.tokens, draft_prefill_tokens=draft.prefilled,
                           draft_prefill_shared_tokens=draft.shared)  # fmt: skip
            out.update(speculative=e.speculative.settings(),
                       spec_decode_drafts=e.drafted[0], spec_decode_draft_tokens=e.drafted[1],
                       spec_decode_accepted_tokens=sum(e.accepted),
                       spec_decode_skipped_rows=e.spec_skipped)  # fmt: skip
        if e.prefix is not None:
            out.update(prefix_cache_tokens=e.prefix.tokens,
                       prefix_cache_hit_tokens=e.prefix.hit_tokens)  # fmt: skip
        if e.resident_tokens is not None:
            out.update(kv_resident_tokens=e.resident, kv_released_bytes=e.released_bytes)
        return out

    def _speculated(self, report: StepReport) -> None:
        """The step's speculation, in ``report``: the engine's counts since the last."""
        from ..generation.padded import PaddedEngine

        e = self.engine
        assert isinstance(e, PaddedEngine)
        rows, drafts = e.drafted
        seen_rows, seen_drafts, seen, skipped = self._spec_seen
        if rows == seen_rows and e.spec_skipped == skipped:
            return
        report.drafted = (rows - seen_rows, drafts - seen_drafts)
        report.accepted = tuple(n - (seen[j] if j < len(seen) else 0)
                                for j, n in enumerate(e.accepted))  # fmt: skip
        report.spec_skipped = e.spec_skipped - skipped
        self._spec_seen = (rows, drafts, tuple(e.accepted), e.spec_skipped)
