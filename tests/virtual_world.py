"""The batch loop's parts in virtual time: a clock that jumps, a scripted intake, a device
whose steps take scripted virtual time, and the in-memory sink.

The loop under test is the real ``BatchLoop`` (scheduler, answers, observers); only the
threads and Redis around it are replaced. Nothing sleeps: waiting for an event advances
the clock to it, so a test of seconds of behaviour runs in milliseconds, the same on a
loaded machine as on an idle one.

(A plain module, not a conftest: ``tests/`` is not a package.)
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchfleet.schemas.codec import decode_result, encode_request
from batchfleet.schemas.messages import Request, Result
from batchfleet.worker.crashes import Crashes
from batchfleet.worker.deltas import DeltaWriter
from batchfleet.worker.executor import execute
from batchfleet.worker.holding import Holding, hung_for
from batchfleet.worker.inbox import Arrived, Event, ReadIdle, StepDone, Wake
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.observers import LoopEvent
from batchfleet.worker.parts import Parts
from batchfleet.worker.runner import BatchRunner, Encoded, Runner, Work, is_continuous
from batchfleet.worker.sink import MemorySink
from batchfleet.worker.streams import Entry

from batchfleet.config import ModelConfig, WorkerConfig

MODEL = "tiny"
T0 = 1_000.0
"""Virtual start time (seconds); stream ids carry it in ms like Redis' do."""


class Stalled(AssertionError):
    """The loop waits for an event that can never come."""


class World:
    """A virtual clock and the callbacks due at virtual times."""

    def __init__(self, start: float = T0) -> None:
        self.now = start
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        return self.now

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), fn))

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run_next(self) -> None:
        when, _, fn = heapq.heappop(self._heap)
        self.now = max(self.now, when)
        fn()


class VirtualInbox:
    """The loop's inbox: waiting runs the world up to the next event or the timeout."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._ready: deque[Event] = deque()

    def put(self, event: Event) -> None:
        self._ready.append(event)

    def get_nowait(self) -> Event | None:
        return self._ready.popleft() if self._ready else None

    def get(self, timeout: float | None) -> Event | None:
        world = self.world
        limit = None if timeout is None else world.now + timeout
        while not self._ready:
            nxt = world.next_time()
            if nxt is None or (limit is not None and nxt > limit):
                if limit is None:
                    raise Stalled(f"the loop waits forever at t={world.now - T0:.4f}")
                world.now = max(world.now, limit)
                return None
            world.run_next()
        return self._ready.popleft()


class ScriptedSource:
    """Entries arrive at scripted times; each grant delivers what has arrived, up to it.

    Like the Redis intake, an empty read under a grant reports ``ReadIdle`` after
    ``block_s``, and a delivery consumes the grant until the loop grants again."""

    def __init__(self, world: World, inbox: VirtualInbox, lanes: int, block_s: float = 0.5) -> None:
        self.world = world
        self.inbox = inbox
        self.block_s = block_s
        self.lanes: list[deque[Entry]] = [deque() for _ in range(lanes)]
        self.counts: dict[int, int] = {}
        self.suspects = True
        self.grants: list[tuple[float, dict[int, int]]] = []
        self.released: list[Entry] = []
        self.holding = Holding()
        """The loop's latest snapshot of what it holds (the intake refreshes its entries)."""
        self.claim_idle_ms = 300_000
        """Set by the rig from the worker's config."""
        self.handovers: list[float] = []
        """When the loop handed a snapshot over."""
        self.started = False
        self._posted = 0
        self._blocking = False
        self._seq = itertools.count()

    def add(
        self,
        request: Request,
        *,
        lane: int = 1,
        at: float | None = None,
        deliveries: int = 1,
        fmt: str = "msgpack",
    ) -> Entry:
        """Queue ``request`` on ``lane``, arriving at virtual time ``at`` (default now)."""
        when = self.world.now if at is None else at
        entry_id = f"{int(when * 1000)}-{next(self._seq)}"
        entry = Entry(lane, entry_id, encode_request(request, fmt), deliveries)  # type: ignore[arg-type]
        self.world.at(when, lambda: self._arrive(entry))
        return entry

    def add_raw(self, fields: dict[bytes, bytes], *, lane: int = 1) -> Entry:
        entry = Entry(lane, f"{int(self.world.now * 1000)}-{next(self._seq)}", fields)
        self.world.at(self.world.now, lambda: self._arrive(entry))
        return entry

    def _arrive(self, entry: Entry) -> None:
        self.lanes[entry.lane].append(entry)
        self._pump()

    # --- the Source protocol ----------------------------------------------------------------

    def start(self, max_depth: int | None) -> None:
        self.started = True

    def grant(self, counts: dict[int, int], suspects: bool, seen: int) -> None:
        if seen < self._posted:
            return
        counts = {lane: n for lane, n in counts.items() if n > 0}
        if counts != self.counts:
            self.grants.append((self.world.now, counts))
        self.counts, self.suspects = counts, suspects
        self._pump()

    def hold(self, holding: Holding) -> None:
        self.holding = holding
        self.handovers.append(self.world.now)

    def hung_for(self) -> float | None:
        return hung_for(self.holding, self.world.now, self.claim_idle_ms)

    @property
    def held(self) -> tuple[Entry, ...]:
        return self.holding.entries

    def _pump(self) -> None:
        if not self.counts:
            return
        taken: list[Entry] = []
        for lane, n in sorted(self.counts.items()):
            q = self.lanes[lane]
            while q and n > 0:
                taken.append(q.popleft())
                n -= 1
        if taken:
            self.counts = {}
            self._posted += 1
            self.inbox.put(Arrived(taken, self.world.now))
        elif not self._blocking:
            self._blocking = True
            self.world.at(self.world.now + self.block_s, self._block_ends)

    def _block_ends(self) -> None:
        self._blocking = False
        if self.counts and not any(self.lanes[lane] for lane in self.counts):
            self.inbox.put(ReadIdle())
            self._pump()

    def stop(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass

    def restart(self) -> None:
        """Start over as the new intake of a loop restarted after a crash (what was read
        stays read: a real one reclaims it later)."""
        self.holding = Holding()
        self.counts, self._posted, self._blocking = {}, 0, False

    def release(self, entries: Sequence[Entry]) -> None:
        self.released += entries

    def unregister(self) -> None:
        pass


@dataclass
class Span:
    step_id: str
    rows: int
    start: float
    end: float


class VirtualDevice:
    """Steps run one at a time in submission order; each takes ``cost(work)`` virtual
    seconds. The runner is called through the real executor's ``execute``, and its crash
    policy (``Crashes``)."""

    def __init__(
        self, world: World, inbox: VirtualInbox, runner: Runner, cost: Callable[[Work], float]
    ) -> None:
        self.world = world
        self.inbox = inbox
        self.runner = runner
        self.cost = cost
        self.spans: list[Span] = []
        self.post: Callable[[StepDone], None] = inbox.put
        """Where a finished step goes (a generating model's: through its DeltaWriter)."""
        self.lag = 0.0
        """Virtual seconds between a step's end and the next one's start (a device thread
        still posting the last step when the loop has taken it in)."""
        self._queue: list[Work] = []
        """Submitted, not started."""
        self._busy = False
        self.crashes = Crashes(runner)

    def start(self) -> None:
        pass

    def submit(self, work: Work) -> None:
        self._queue.append(work)
        if not self._busy:
            self._start_next()

    def _start_next(self) -> None:
        work = self._queue.pop(0)
        self._busy = True
        start = self.world.now
        end = start + self.cost(work)
        self.spans.append(Span(work.step_id, sum(p.rows for _, p in work.admit), start, end))
        report = self.crashes.checked(work, execute(self.runner, work, lambda: start).report)

        def finish() -> None:
            self.post(StepDone(work.step_id, report, start, end))
            self.crashes.track(work, report)
            if self.lag:
                self.world.at(self.world.now + self.lag, idle)
            else:
                idle()

        def idle() -> None:
            self._busy = False
            if self._queue:
                self._start_next()

        self.world.at(end, finish)

    def drop_queued(self) -> list[Work]:
        queued, self._queue = self._queue, []
        return queued

    @property
    def alive(self) -> bool:
        return self._busy

    @property
    def crashed_in_a_row(self) -> int:
        return self.crashes.in_a_row

    def close(self, timeout: float | None = None) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        """Run the world until the device is idle, at most ``timeout`` virtual seconds."""
        world = self.world
        limit = None if timeout is None else world.now + timeout
        while self._busy:
            nxt = world.next_time()
            if nxt is None or (limit is not None and nxt > limit):
                if limit is not None:
                    world.now = max(world.now, limit)
                return not self._busy
            world.run_next()
        return True


def linear_cost(base: float = 0.020, per_row: float = 0.001) -> Callable[[Work], float]:
    """A GPU-like cost: ``base + per_row * rows`` virtual seconds."""
    return lambda work: base + per_row * sum(p.rows for _, p in work.admit)


class Words(BatchRunner):
    """A scripted one-shot model: a row's tokens are its words; outputs their count.
    ``poison`` raises for a text; ``oom_above`` raises torch's OOM above that many rows."""

    name = "words"

    def __init__(
        self, path: object = None, *, poison: str | None = None, oom_above: int = 0, **_: Any
    ) -> None:
        self.poison = poison
        self.oom_above = oom_above
        self.runs: list[int] = []

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        return [
            Encoded(
                ids=tuple(sum(map(ord, w)) % 1000 for w in t.split()), type_ids=(), truncated=False
            )
            for t in texts
        ]

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        if self.oom_above and len(rows) > self.oom_above:
            import torch

            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({len(rows)} rows, fake)")
        if self.poison is not None and any(r.ids == self._poison_ids for r in rows):
            raise RuntimeError("this input breaks the model")
        self.runs.append(len(rows))
        return [len(r.ids) for r in rows]

    @property
    def _poison_ids(self) -> tuple[int, ...]:
        return self.encode([self.poison or ""])[0].ids


@dataclass
class Recorder:
    """An observer keeping every event with the virtual time it came at."""

    world: World
    events: list[tuple[float, LoopEvent]] = field(default_factory=list)

    def notify(self, event: LoopEvent) -> None:
        self.events.append((self.world.now, event))

    def of(self, kind: type[Any]) -> list[tuple[float, Any]]:
        return [(t, e) for t, e in self.events if isinstance(e, kind)]


@dataclass
class Rig:
    """A loop wired to virtual parts, with handles on each."""

    world: World
    loop: BatchLoop
    source: ScriptedSource
    device: VirtualDevice
    sink: MemorySink
    recorder: Recorder

    def submit(self, text: str | list[str], *, rid: str | None = None, at: float | None = None,
               lane: int = 1, deadline_ms: int | None = None, deliveries: int = 1,
               reply: str | None = None) -> str:  # fmt: skip
        rid = rid or f"r{next(_ids)}"
        inputs = [text] if isinstance(text, str) else text
        req = Request(id=rid, model=MODEL, inputs=inputs, deadline_ms=deadline_ms, reply=reply)
        self.source.add(req, lane=lane, at=at, deliveries=deliveries)
        return rid

    def result(self, rid: str) -> Result:
        return decode_result(self.sink.results[rid])

    def results(self) -> dict[str, Result]:
        return {rid: decode_result(raw) for rid, raw in self.sink.results.items()}

    def run(self) -> None:
        self.loop.run()


_ids = itertools.count()


def rig(
    runner: Runner | None = None,
    *,
    batch: dict[str, Any] | None = None,
    worker: dict[str, Any] | None = None,
    cost: Callable[[Work], float] | None = None,
    burst: bool = True,
    hold: bool = False,
    lanes: int = 3,
    limits: dict[str, Any] | None = None,
) -> Rig:
    """A loop on virtual parts (burst mode: ``run`` returns once all is answered)."""
    world = World()
    inbox = VirtualInbox(world)
    source = ScriptedSource(world, inbox, lanes)
    runner = runner or Words()
    device = VirtualDevice(world, inbox, runner, cost or linear_cost())
    recorder = Recorder(world)
    sink_box: list[MemorySink] = []

    def parts(loop: BatchLoop) -> Parts:
        source.claim_idle_ms = loop.worker.claim_idle_ms
        sink = MemorySink(MODEL, loop.observers, lambda: inbox.put(Wake()), hold=hold)
        sink_box.append(sink)
        if not is_continuous(runner):
            return Parts(world.clock, inbox, source, device, sink)
        deltas = DeltaWriter(sink.stream_now, inbox.put)
        device.post = deltas.post
        return Parts(world.clock, inbox, source, device, sink, deltas=deltas)

    cfg = ModelConfig(lanes=lanes, batch=batch or {}, limits=limits or {})
    loop = BatchLoop(MODEL, cfg, runner, consumer="v1", worker=WorkerConfig(**(worker or {})),
                     burst=burst, observers=[recorder], parts=parts)  # fmt: skip
    return Rig(world, loop, source, device, sink_box[0], recorder)
