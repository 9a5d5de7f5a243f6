"""``batchfleet top``: the ``status`` tables, redrawn every ``--interval``.

A redraw that cannot read Redis (a master gone silent, a cluster failing over, the server
restarting) keeps the last tables on screen under a line that says so and since when, and
the next redraw reads again: the view outlasts an outage rather than ending in a traceback.
Each read is bounded by ``timeout`` and not retried (the next redraw is the retry), so the
view never hangs for the client's whole retry budget (a minute, on a silent master).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from .redis_errors import FAILED_CALL
from .status import FleetStatus, gather, render


class TopView:
    """The frames of ``top``: each :meth:`frame` reads the fleet once (``read``)."""

    def __init__(self, read: Callable[[], FleetStatus],
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        self._read = read
        self._clock = clock
        self._last: tuple[Group, float] | None = None
        """The tables last read, and when."""

    def frame(self) -> RenderableType:
        """The fleet's tables now; where Redis cannot be read, the last ones with a line
        saying why (the first read's failure is raised: there is nothing to show)."""
        try:
            status = self._read()
        except FAILED_CALL as exc:
            if self._last is None:
                raise
            tables, at = self._last
            when = time.strftime("%H:%M:%S", time.localtime(at))
            note = Text(f"cannot read Redis: {type(exc).__name__}: {exc}; the tables are "
                        f"of {when}, read again at each refresh", style="bold red")  # fmt: skip
            return Group(tables, note)
        tables = render(status)
        self._last = (tables, self._clock())
        return tables


def top(
    redis_url: str,
    models: Sequence[str] | None = None,
    *,
    interval: float = 2.0,
    iterations: int | None = None,
    workers: bool = True,
    broker_url: str | None = None,
    timeout: float = 5.0,
) -> None:
    """``batchfleet top``: the tables, redrawn every ``interval`` seconds (``iterations``
    times; None: until interrupted), each read of Redis bounded by ``timeout`` seconds.
    Raises where the first read fails."""

    def read() -> FleetStatus:
        return gather(redis_url, models, workers=workers, broker_url=broker_url,
                      socket_timeout=timeout, retries=0)  # fmt: skip

    view = TopView(read)
    with Live(view.frame(), refresh_per_second=4, screen=False) as live:
        done = 0
        while iterations is None or done < iterations:
            time.sleep(interval)
            live.update(view.frame())
            done += 1
