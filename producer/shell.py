"""What both producer shells hold: a URL, a client, the submit script and the core."""

from __future__ import annotations

from typing import Generic, TypeVar

from typing_extensions import Unpack

from ..connection import AsyncClient, SyncClient, default_url
from ..schemas.messages import Format, Limits, Request
from .core import CoreOptions, JobRef, ProducerCore
from .submit import SUBMIT_LUA

C = TypeVar("C", bound=SyncClient | AsyncClient)
J = TypeVar("J")

STREAM_TIMEOUT_S = 120.0
"""Default of ``job.stream(timeout=)`` and ``job.deltas(timeout=)``: the whole generation."""
CANCEL_TTL_S = 3600
"""Default life of a cancel key: it must outlast the request's wait in the queue."""


class ProducerShell(Generic[C, J]):
    """``Producer(url)`` or ``Producer(client=...)``, with the options of
    :class:`~batchfleet.producer.core.CoreOptions`: connection errors are retried with backoff
    for ``retry_for_s`` seconds before :class:`Unavailable` is raised (docs/reliability.md)."""

    def __init__(
        self, url: str | None = None, *, client: C | None = None, **options: Unpack[CoreOptions]
    ) -> None:
        self.url = url or default_url()
        self.client: C = client if client is not None else self._connect(self.url)
        self._submit = self.client.register_script(SUBMIT_LUA)
        self.core: ProducerCore[J] = ProducerCore(self.url, self._job, **options)
        self.client_id = self.core.client_id
        self.reply_channel = self.core.reply_channel

    @property
    def limits(self) -> Limits:
        return self.core.limits

    @property
    def wire_format(self) -> Format:
        return self.core.wire_format

    @property
    def default_priority(self) -> int:
        return self.core.default_priority

    def _connect(self, url: str) -> C:
        """The client, made from the URL when none is given."""
        raise NotImplementedError

    def _job(self, request: Request) -> J:
        raise NotImplementedError

    @staticmethod
    def _target(job: JobRef | str, model: str | None) -> tuple[str, str]:
        """``(model, request id)`` of a job, or of an id and ``model``."""
        if isinstance(job, JobRef):
            return job.model, job.id
        if model is None:
            raise ValueError("cancel(request_id) needs model=")
        return model, job
