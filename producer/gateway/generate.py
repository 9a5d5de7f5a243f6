"""The :class:`Generate` handler: chat and text completions, whole or streamed as
server-sent events; the base of the other generation APIs (Responses, Messages).

Its client leaving (the connection closed) cancels its request, so the fleet stops
generating for nobody.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import tornado.iostream

from ...schemas.errors import BatchfleetError
from ...schemas.messages import Result
from ..aio import AsyncJob
from ..submit import new_request_id
from ..tokens import Restarted
from . import openai_fields
from .answers import chat_response, completion_response
from .chunks import Chunks, Diverged
from .endpoint import Answered, Events, Submission
from .errors import ApiError, of_exception, of_result
from .handler import Handler, dumps
from .state import Gateway


def _named(alias: str | None) -> Callable[[Result], Result]:
    """A result as answered under ``alias`` (a LoRA adapter's name: vLLM's answers name
    the model asked for), or as it is."""
    if alias is None:
        return lambda result: result
    return lambda result: result.model_copy(update={"model": alias})


class Generate(Handler):
    """``/v1/chat/completions`` (``chat``) and ``/v1/completions``: whole, or streamed as
    server-sent events. A subclass serves another generation API by overriding the
    translations (:meth:`submission`, :meth:`answer`, :meth:`events`, :meth:`error_body`)
    and the stream's framing (:attr:`named`, :meth:`_write`, :meth:`_end`, :meth:`_end_with`)."""

    load_aware = True

    def initialize(self, gateway: Gateway, chat: bool) -> None:  # type: ignore[override]
        super().initialize(gateway)
        self.serves(chat)

    def serves(self, chat: bool) -> None:
        """What it answers: a chat (``chat``) or a text completion (``/invocations`` says
        once it read the body)."""
        self.chat = chat
        self.prefix = "chatcmpl-" if chat else "cmpl-"
        """Of the response's id."""
        self.named = False
        """Events written under their ``type`` (``event: <type>``), no ``[DONE]`` after
        them: the Responses and Messages APIs' streams (chunks are ``data:`` only)."""
        self.job: AsyncJob | None = None

    def submission(self, body: Mapping[str, Any]) -> Submission:
        make = openai_fields.chat_submission if self.chat else openai_fields.completion_submission
        return make(self._defaulted(body))

    def answer(self, body: Mapping[str, Any], result: Result, answered: Answered) -> Any:
        make = chat_response if self.chat else completion_response
        return make(self._defaulted(body), result, answered)

    def events(self, body: Mapping[str, Any], answered: Answered, model: str) -> Events:
        return Chunks(self._defaulted(body), answered, model, self.chat)

    def _defaulted(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.gateway.token_ids_default(body)

    async def expand(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """The body to serve: as sent, here; the Responses API puts the stored
        conversation a ``previous_response_id`` continues in it."""
        return body

    async def detached(self, sub: Submission, body: Mapping[str, Any], alias: str | None) -> bool:
        """Answer without waiting for the result (True: answered): never, here; the
        Responses API's ``background`` does."""
        return False

    async def keep(self, answer: Any) -> None:
        """Called with the whole answer (streamed: the last events) before it is sent:
        nothing here; the Responses API stores it."""

    async def post(self) -> None:
        started = False
        body: Mapping[str, Any] = {}
        try:
            body = await self.expand(self.body_json())
            sub, alias = await self.gateway.served(self.submission(body))
            named = _named(alias)
            if await self.detached(sub, body, alias):
                return
            if not body.get("stream"):
                self.job = await self.submit(sub, body)
                answered = await self._answered(self.job, sub.model)
                result = named(await self.gateway.replies.wait(self.job, self.gateway.timeout_s))
                if self.gone:
                    return
                if not result.ok:
                    raise of_result(result)
                self.count_tokens(result)
                answer = self.answer(body, result, answered)
                await self.keep(answer)
                return self.send_json(answer)
            rid = self.request_id(body).get("request_id") or new_request_id()
            with self.gateway.replies.stream(sub.model, rid):
                self.job = await self.submit(sub, body, rid)
                answered = await self._answered(self.job, sub.model)
                chunks = self.events(body, answered, alias or self.job.model)
                async for event in self.gateway.replies.events(self.job, self.gateway.timeout_s):
                    if isinstance(event, Result):
                        event = named(event)
                        if not event.ok:
                            raise of_result(event)
                        self.count_tokens(event)
                        out = chunks.finish(event)
                        await self.keep(out)
                    else:
                        if isinstance(event, Restarted):
                            self.gateway.metrics.restarts.inc()
                        out = chunks.feed(event)
                    if out:
                        started = started or self._start()
                        self._write(out)
                    if started and not self.gateway.replies.backlog(rid):
                        await self._flush()
            self._end()
        except tornado.iostream.StreamClosedError:
            self._left()
        except Diverged as exc:
            self._left()
            self._end_with(ApiError(500, str(exc), code="stream_restarted"))
        except (ApiError, BatchfleetError) as exc:
            error = exc if isinstance(exc, ApiError) else of_exception(exc, body)
            if not started:
                return self.fail(error)
            self._end_with(error)

    async def _answered(self, job: AsyncJob, model: str) -> Answered:
        """What the answer to ``job`` (submitted) names besides its result."""
        return Answered(
            f"{self.prefix}{job.id}",
            int(time.time()),
            sampling=await self.gateway.sampling(model),
            frontend=self.gateway.frontend,
            system_fingerprint=await self.gateway.fingerprints.of(model),
        )

    def _start(self) -> bool:
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.gateway.metrics.first_event.labels(self.route).observe(self.request.request_time())
        return True

    def _write(self, chunks: list[dict[str, Any]]) -> None:
        if self.gone:
            raise tornado.iostream.StreamClosedError()
        if self.named:
            self.write("".join([f"event: {e['type']}\ndata: {dumps(e)}\n\n" for e in chunks]))
        else:  # (a list: join makes one of a generator first)
            self.write("".join([f"data: {dumps(e)}\n\n" for e in chunks]))

    async def _flush(self) -> None:
        """Send what was written (once the stream's delivered events are all written)."""
        if self.gone:
            raise tornado.iostream.StreamClosedError()
        await self.flush()

    def _end(self) -> None:
        """The stream is whole."""
        if not self.named:
            self.write("data: [DONE]\n\n")
        self.finish()

    def _end_with(self, error: ApiError) -> None:
        """A stream that already began ends with an error event (as vLLM's do)."""
        if self.gone:
            return
        self._write([self.error_body(error)])
        self._end()

    def _left(self) -> None:
        if self.job is not None and not self._finished:
            self.gateway.cancel(self.job)

    def on_connection_close(self) -> None:
        super().on_connection_close()
        self._left()
