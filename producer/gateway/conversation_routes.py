"""``/v1/conversations``: OpenAI's Conversations API, its conversations kept in Redis
(``conversations.py``). A response made with ``conversation`` continues one and adds its
input and output to it (``respond.py``).

Items are stored as the API answers them: each with an ``id`` (the client's, or made here
as a response's input items' are), a message's text content as an ``input_text`` (an
assistant's: ``output_text``) part, and its ``status``.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from .conversations import Conversation, ConversationGone, ItemsRefused
from .errors import ApiError, invalid
from .handler import Handler
from .response_input import ITEM_PREFIX, LOGPROBS, input_messages

MAX_ADDED = 20
"""Items one request may add (OpenAI's bound)."""
MAX_METADATA = 16
ITEM_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


def conversation_not_found(conversation_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Conversation with id '{conversation_id}' not found.",
                    code="not_found", param=param, kind="invalid_request_error")  # fmt: skip


def metadata(raw: Any) -> dict[str, str]:
    """``metadata``: up to 16 pairs of a key of at most 64 characters and a text of at most
    512 (OpenAI's bounds); none: empty."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or len(raw) > MAX_METADATA:
        raise invalid(f"metadata is an object of at most {MAX_METADATA} pairs", "metadata")
    for key, value in raw.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise invalid("metadata keys are at most 64 characters, its values texts of at "
                          "most 512", f"metadata.{key[:64]}")  # fmt: skip
    return dict(raw)


def stored_item(item: Mapping[str, Any], item_id: str) -> dict[str, Any]:
    """``item`` as a conversation holds it: with ``item_id`` (its own, where it has one) and,
    a message, its content as parts and a ``status``."""
    out = {"id": item_id, **item}
    out.setdefault("type", "message")
    if out["type"] == "message":
        if isinstance(out.get("content"), str):
            part = "output_text" if out.get("role") == "assistant" else "input_text"
            extra: dict[str, Any] = {"annotations": []} if part == "output_text" else {}
            out["content"] = [{"type": part, "text": out["content"], **extra}]
        out.setdefault("status", "completed")
    return out


def new_items(raw: Any, most: int = MAX_ADDED) -> list[dict[str, Any]]:
    """``items`` (a list of 1 to ``most`` Responses API input items) as stored, each with
    an id (``msg_<random>``, ... where it has none); a bad one is refused under its index."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= most:
        raise invalid(f"items must be a list of 1 to {most} items", "items")
    try:
        input_messages(raw)
    except ApiError as exc:  # the checks name the field input
        param = exc.param or "input"
        raise invalid(exc.message.replace("input", "items"),
                      "items" + param.removeprefix("input")) from None  # fmt: skip
    out = []
    for i, item in enumerate(raw):
        given = item.get("id")
        if given is not None and not (isinstance(given, str) and ITEM_ID.match(given)):
            raise invalid("an item's id has 1-200 of letters, digits and _.:-", f"items[{i}].id")
        prefix = ITEM_PREFIX.get(item.get("type", "message"), "item")
        out.append(stored_item(item, given or f"{prefix}_{uuid.uuid4().hex}"))
    return out


def shown(item: Mapping[str, Any], logprobs: bool) -> Mapping[str, Any]:
    """``item`` as answered: its text's log-probabilities only where ``include`` asks."""
    content = item.get("content")
    if logprobs or item.get("type") != "message" or not isinstance(content, list):
        return item
    return {**item, "content": [{**p, "logprobs": []} if isinstance(p, Mapping)
                                and p.get("logprobs") else p for p in content]}  # fmt: skip


def listed(data: list[Any], has_more: bool) -> dict[str, Any]:
    """OpenAI's list object."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}  # fmt: skip


class ConversationHandler(Handler):
    """Shared by the conversation routes: the body, the conversation named in the path."""

    def logprobs(self) -> bool:
        """``include`` asks for the output text's log-probabilities."""
        return LOGPROBS in self.get_arguments("include") + self.get_arguments("include[]")

    async def found(self, conversation_id: str) -> Conversation:
        conversation = await self.gateway.conversations.get(conversation_id)
        if conversation is None:
            raise conversation_not_found(conversation_id)
        return conversation

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """An :class:`ApiError` raised in a route is its answer; a conversation gone
        meanwhile (deleted, expired) is a 404."""
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ApiError):
            return self.fail(exc)
        if isinstance(exc, ConversationGone):
            return self.fail(conversation_not_found(str(exc)))
        super().write_error(status_code, **kwargs)

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if not isinstance(value, (ApiError, ConversationGone)):  # answers, not failures
            super().log_exception(typ, value, tb)


class Conversations(ConversationHandler):
    """``POST /v1/conversations``: a new conversation, with up to 20 ``items`` and its
    ``metadata``."""

    async def post(self) -> None:
        body = self.body_json()
        meta = metadata(body.get("metadata"))
        raw = body.get("items")
        items = [] if raw is None or raw == [] else new_items(raw)
        try:
            made = await self.gateway.conversations.create(meta, items, int(time.time()))
        except ItemsRefused as exc:
            raise invalid(str(exc), "items") from None
        self.send_json(made.body())


class ConversationObject(ConversationHandler):
    """``GET``, ``POST`` (its ``metadata`` replaced) and ``DELETE /v1/conversations/{id}``."""

    async def get(self, conversation_id: str) -> None:
        self.send_json((await self.found(conversation_id)).body())

    async def post(self, conversation_id: str) -> None:
        body = self.body_json()
        if "metadata" not in body:
            raise invalid("metadata is required: the conversation's new metadata", "metadata")
        meta = metadata(body["metadata"])
        self.send_json((await self.gateway.conversations.update(conversation_id, meta)).body())

    async def delete(self, conversation_id: str) -> None:
        if not await self.gateway.conversations.delete(conversation_id):
            raise conversation_not_found(conversation_id)
        self.send_json({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


class ConversationItems(ConversationHandler):
    """``POST /v1/conversations/{id}/items``: add up to 20 ``items`` (answered as a list);
    ``GET``: list them as OpenAI does: ``order`` (``desc``, the default, or ``asc``),
    ``limit`` (1-100, 20) items ``after`` the one of that id."""

    async def post(self, conversation_id: str) -> None:
        items = new_items(self.body_json().get("items"))
        try:
            await self.gateway.conversations.append(conversation_id, items)
        except ItemsRefused as exc:
            raise invalid(str(exc), "items") from None
        logprobs = self.logprobs()
        self.send_json(listed([shown(i, logprobs) for i in items], False))

    async def get(self, conversation_id: str) -> None:
        order = self.get_argument("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order is asc or desc", "order")
        try:
            limit = int(self.get_argument("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise invalid("limit is an integer from 1 to 100", "limit")
        await self.found(conversation_id)
        after = self.get_argument("after", None)
        try:
            page = await self.gateway.conversations.page(conversation_id, limit,
                                                         desc=order == "desc", after=after)  # fmt: skip
        except KeyError:
            raise invalid(f"no item {after!r} in this conversation", "after") from None
        logprobs = self.logprobs()
        self.send_json(listed([shown(i, logprobs) for i in page.data], page.has_more))


class ConversationItem(ConversationHandler):
    """``GET /v1/conversations/{id}/items/{item_id}``: one item; ``DELETE``: delete it,
    answered with the conversation."""

    async def get(self, conversation_id: str, item_id: str) -> None:
        await self.found(conversation_id)
        item = await self.gateway.conversations.item(conversation_id, item_id)
        if item is None:
            raise item_not_found(item_id)
        self.send_json(shown(item, self.logprobs()))

    async def delete(self, conversation_id: str, item_id: str) -> None:
        if not await self.gateway.conversations.remove(conversation_id, item_id):
            raise item_not_found(item_id)
        self.send_json((await self.found(conversation_id)).body())


def item_not_found(item_id: str) -> ApiError:
    return ApiError(404, f"Item with id '{item_id}' not found.", code="not_found",
                    kind="invalid_request_error")  # fmt: skip
