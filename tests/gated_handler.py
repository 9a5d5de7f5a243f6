"""An embedding handler that waits for files to appear: a slow model load and a slow batch,
each released by the test (for the health endpoint's unready phases)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchfleet.worker.runner import Encoded
from batchfleet.worker.runners.embedding import EmbeddingRunner


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)


class GatedEmbedding(EmbeddingRunner):
    """Loading waits for ``<gate>/load``; each batch marks ``<gate>/running``, waits for ``<gate>/run``."""

    def __init__(
        self, path: str | Path, *, options: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        self.gate = Path(str((options or {})["gate"]))
        _wait_for(self.gate / "load")
        super().__init__(path, options={}, **kw)

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        (self.gate / "running").touch()
        _wait_for(self.gate / "run")
        return super().run(rows)
