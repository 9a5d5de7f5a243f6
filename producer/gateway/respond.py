"""``/v1/responses``: OpenAI's Responses API, served as :class:`~.generate.Generate` serves
chat (the same submission, waiting, disconnects and restarts), with the Responses API's
objects and its semantic server-sent events (``event: <type>`` then ``data: <json>``).

With ``store`` (the default) each response is stored once answered (``stored.py``), with
the input items it was built from: ``previous_response_id`` continues it (its input and
output before the new input; not its ``instructions``, as OpenAI's), and
``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read or
delete it. With ``background`` it is answered at once, ``queued``, and polled with ``GET``
until final, or cancelled (``POST /v1/responses/{id}/cancel``): ``background.py``; with
``stream`` too, its events are streamed, and resumed by ``GET ...?stream=true``:
``background_events.py``."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import redis

from ...schemas.errors import BatchfleetError
from ...schemas.messages import Result
from .background import PENDING, job, pending, queued, settle
from .background_events import send
from .continued import Continued, continued
from .endpoint import Answered, Events, Submission
from .errors import ApiError, invalid, of_exception
from .generate import Generate
from .handler import Handler
from .replies import DOWN
from .response_input import ITEM_PREFIX, input_items, input_messages, response_submission
from .responses import ResponseEvents, response
from .state import Gateway
from .stored import Stored

logger = logging.getLogger(__name__)


def not_found(response_id: str, param: str | None = None) -> ApiError:
    """OpenAI's answer for a response it does not hold (``param``: the field that named it)."""
    previous = "Previous response" if param else "Response"
    return ApiError(404, f"{previous} with id '{response_id}' not found.",
                    code="previous_response_not_found" if param else "not_found", param=param,
                    kind="invalid_request_error")  # fmt: skip


class Responses(Generate):
    """The Responses API: whole (a ``response`` object) or streamed (its events)."""

    def initialize(self, gateway: Gateway) -> None:  # type: ignore[override]
        super().initialize(gateway, chat=True)
        self.prefix, self.named = "resp_", True
        self.sequence = 0
        """The next event's ``sequence_number`` (an error event's, after the others)."""
        self.conversation: list[dict[str, Any]] = []
        """The input items the response is built from (the previous response's first)."""
        self.continued: Continued | None = None
        """The conversation object (``conversation``) the response continues."""

    async def expand(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """``input`` as items after the stored conversation ``previous_response_id``
        continues (404 where none is stored), or the items of the conversation object
        ``conversation`` names (``continued.py``); ``store`` as it will be."""
        store = body.get("store")
        if store is not None and not isinstance(store, bool):
            raise invalid("store must be a boolean", "store")
        background = body.get("background")
        if background is not None and not isinstance(background, bool):
            raise invalid("background must be a boolean", "background")
        stored = store is not False and self.gateway.responses.enabled
        if background and not stored:
            raise invalid("background requires store: a background response is polled from "
                          "the store" + ("" if store is False else ", and storing is off here"),
                          "store")  # fmt: skip
        new = input_items(body.get("input"))
        input_messages(new)  # a bad item is refused under its own index
        if body.get("conversation") is not None:
            self.continued = await continued(self.gateway, body, new)
            self.conversation = self.continued.items + new
            return {**body, "input": self.conversation, "store": stored,
                    "conversation": {"id": self.continued.id}}  # fmt: skip
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise invalid("previous_response_id must be a string", "previous_response_id")
            found = await self.gateway.responses.get(previous)
            if found is None:
                raise not_found(previous, "previous_response_id")
            found = await settle(self.gateway, found)
            if found.response["status"] in PENDING:
                raise invalid(f"Previous response with id '{previous}' is still "
                              f"{found.response['status']}: poll it until it is final",
                              "previous_response_id")  # fmt: skip
            new = found.conversation + new
        self.conversation = new
        return {**body, "input": new, "store": stored}

    def items(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation as stored: each input item with an id (made where it has none)."""
        suffix = response_id.removeprefix("resp_")
        return [item if "id" in item else
                {**item, "id": f"{ITEM_PREFIX.get(item.get('type', 'message'), 'item')}_"
                               f"{suffix}_{i}"}
                for i, item in enumerate(self.conversation)]  # fmt: skip

    async def keep(self, answer: Any) -> None:
        """Store the whole response (streamed: the last event's) before it is sent; one
        not stored (over the size bound, Redis failing) says ``store: false``. With
        ``conversation``, it is added to the conversation first (else an error answers)."""
        whole = answer if isinstance(answer, dict) else answer[-1]["response"]
        if self.continued is not None:
            await self.continued.add(self.items(whole["id"]), whole["output"])
        if not whole["store"]:
            return
        try:
            stored = await self.gateway.responses.put(whole, self.items(whole["id"]))
        except (*DOWN, redis.ResponseError) as exc:
            logger.warning("response %s not stored: %s", whole["id"], exc)
            stored = False
        if not stored:
            whole["store"] = False

    async def detached(self, sub: Submission, body: Mapping[str, Any], alias: str | None) -> bool:
        """``background``: submitted streamed (its token stream holds its deltas), its
        fleet result kept as long as the response is (bounded by the fleet's limit), stored ``queued`` and answered so at once (True), or with ``stream`` its
        events streamed (the client leaving does not cancel it). A response not stored
        (over the size bound, Redis failing) is cancelled and refused: nothing could ever
        answer it."""
        if not body.get("background"):
            return False
        ttl = min(self.gateway.responses.ttl_s, self.gateway.producer.limits.max_result_ttl_s)
        options = sub.options | {"result_ttl_s": ttl, "stream": True}
        fleet = await self.submit(Submission(sub.model, options), body)
        self.gateway.inflight.discard(fleet)  # no client waits on it: a shutdown keeps it
        answered = Answered(
            f"resp_{fleet.id}", int(time.time()), sampling=await self.gateway.sampling(sub.model)
        )
        whole = queued(body, answered, alias or fleet.model)
        finishing = pending(fleet.model, alias, body)
        try:
            if self.continued is not None:  # added to it once settled
                finishing |= self.continued.pending()
            stored = await self.gateway.responses.put(whole, self.items(whole["id"]), finishing,
                                                      replay=finishing)  # fmt: skip
        except BaseException:
            self.gateway.cancel(fleet)
            raise
        if not stored:
            self.gateway.cancel(fleet)
            raise invalid("a background response this large cannot be stored (the gateway's "
                          "--responses-max-bytes): send it without background", "background")  # fmt: skip
        if body.get("stream"):
            await send(self, Stored(whole, self.items(whole["id"]), finishing, finishing))
        else:
            self.send_json(whole)
        return True

    def submission(self, body: Mapping[str, Any]) -> Submission:
        return response_submission(body)

    def answer(self, body: Mapping[str, Any], result: Result, answered: Answered) -> Any:
        return response(body, result, answered)

    def events(self, body: Mapping[str, Any], answered: Answered, model: str) -> Events:
        return ResponseEvents(body, answered, model)

    def _write(self, chunks: list[dict[str, Any]]) -> None:
        super()._write(chunks)
        self.sequence = chunks[-1]["sequence_number"] + 1

    def _end_with(self, error: ApiError) -> None:
        """A stream that already began ends with an ``error`` event (OpenAI's)."""
        if self.gone:
            return
        self._write([{"type": "error", "code": error.code, "message": error.message,
                      "param": error.param, "sequence_number": self.sequence}])  # fmt: skip
        self._end()


class StoredResponse(Handler):
    """``GET /v1/responses/{id}``: a stored response (a background one settled first:
    ``background.py``), or with ``stream=true`` a background one's events after
    ``starting_after`` (``background_events.py``); ``DELETE``: delete it (a background one
    not final: cancelled)."""

    async def get(self, response_id: str) -> None:
        stream = self.get_argument("stream", "false").lower()
        if stream not in ("true", "false"):
            return self.fail(invalid("stream must be true or false", "stream"))
        after = self.get_argument("starting_after", None)
        if after is not None and not after.isdigit():
            return self.fail(invalid("starting_after must be an event's sequence_number (an "
                                     "integer, 0 or more)", "starting_after"))  # fmt: skip
        found = await self.gateway.responses.get(response_id)
        if found is None:
            return self.fail(not_found(response_id))
        if stream == "false":
            return self.send_json((await settle(self.gateway, found)).response)
        refused = await self.unstreamable(found)
        if refused is not None:
            return self.fail(invalid(refused, "stream"))
        await send(self, found, -1 if after is None else int(after))

    async def unstreamable(self, found: Stored) -> str | None:
        """Why ``found``'s events cannot be streamed (None: they can)."""
        if not found.response.get("background"):
            return ("Only a response created with background can be streamed: GET it "
                    "without stream")  # fmt: skip
        if found.replay is None:
            return ("This background response was created by an older gateway, which did "
                    "not keep its events: GET it without stream")  # fmt: skip
        fleet = job(self.gateway, found)
        if found.pending is None and not await self.gateway.producer.client.exists(
            fleet.result_key
        ):
            return ("The events of this response are no longer kept (they expire with its "
                    "fleet result, after the fleet's max_result_ttl_s): GET it without stream")  # fmt: skip
        return None

    async def delete(self, response_id: str) -> None:
        found = await self.gateway.responses.get(response_id)
        if found is not None and found.pending is not None:  # no one will read its result
            self.gateway.cancel(job(self.gateway, found))
        if not await self.gateway.responses.delete(response_id):
            return self.fail(not_found(response_id))
        self.send_json({"id": response_id, "object": "response", "deleted": True})


class CancelResponse(Handler):
    """``POST /v1/responses/{id}/cancel``: a background response not yet final is cancelled
    (its fleet request too) and answered ``cancelled`` (with the text its fleet result will
    hold, once there); one cancelled already is answered again; any other is refused."""

    async def post(self, response_id: str) -> None:
        found = await self.gateway.responses.get(response_id)
        if found is None:
            return self.fail(not_found(response_id))
        found = await settle(self.gateway, found)
        was = found.response
        if was["status"] == "cancelled":
            return self.send_json(was)
        if not was.get("background"):
            return self.fail(invalid("Only responses created with background can be cancelled."))
        if found.pending is None:
            return self.fail(invalid(f"Cannot cancel a response with status '{was['status']}'."))
        try:
            await job(self.gateway, found).cancel(ttl_s=self.gateway.responses.ttl_s)
        except BatchfleetError as exc:  # Redis away past the producer's retries
            return self.fail(of_exception(exc))
        cancelled = was | {"status": "cancelled"}
        await self.gateway.responses.put(cancelled, found.input, found.pending,
                                         replay=found.replay, again=True)  # fmt: skip
        self.send_json(cancelled)


class InputItems(Handler):
    """``GET /v1/responses/{id}/input_items``: the input items a stored response was built
    from (its previous responses' included), as OpenAI lists them: ``order`` (``desc``, the
    default, or ``asc``), ``limit`` (1-100, 20) items ``after`` the one of that id."""

    async def get(self, response_id: str) -> None:
        order = self.get_argument("order", "desc")
        if order not in ("asc", "desc"):
            return self.fail(invalid("order is asc or desc", "order"))
        try:
            limit = int(self.get_argument("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            return self.fail(invalid("limit is an integer from 1 to 100", "limit"))
        found = await self.gateway.responses.get(response_id)
        if found is None:
            return self.fail(not_found(response_id))
        items = found.input if order == "asc" else found.input[::-1]
        after = self.get_argument("after", None)
        if after is not None:
            at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
            if at is None:
                return self.fail(invalid(f"no input item {after!r} in this response", "after"))
            items = items[at + 1 :]
        page = items[:limit]
        self.send_json({"object": "list", "data": page,
                        "first_id": page[0]["id"] if page else None,
                        "last_id": page[-1]["id"] if page else None,
                        "has_more": len(items) > limit})  # fmt: skip
