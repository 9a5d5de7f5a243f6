"""OpenAI's Conversations API's conversations, in Redis: each one's creation time and
metadata, and its items in the order they were added (``ConversationKeys``).

Every write is one Lua script (``conversation_write.lua``, ``conversation_remove.lua``),
so gateways that append to one conversation at once each append whole, none lost, and the
bounds (items, bytes) hold. OpenAI's conversations do not expire; here each expires
``ttl_s`` after its last write (0: never), a write being any change, a response's included.
"""

from __future__ import annotations

import importlib.resources
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from ...connection import AsyncClient
from ...schemas.keys import CONVERSATION_ID, ConversationKeys

DEFAULT_TTL_S = 30 * 24 * 3600
DEFAULT_MAX_ITEMS = 1000
DEFAULT_MAX_BYTES = 4 * 1024 * 1024

_LUA = importlib.resources.files("batchfleet.producer") / "lua"
WRITE_LUA = (_LUA / "conversation_write.lua").read_text()
REMOVE_LUA = (_LUA / "conversation_remove.lua").read_text()


class ConversationGone(LookupError):
    """No such conversation: never made, expired or deleted."""


class ItemsRefused(ValueError):
    """Items a conversation cannot take: past its bounds, or an id it holds already."""


class DuplicateItem(ItemsRefused):
    """An item of an id the conversation holds already (or given twice)."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """A conversation's object, as the API answers it."""

    id: str
    created_at: int
    metadata: dict[str, str]

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Page:
    """Items listed: a page of them, and whether more follow it."""

    data: list[dict[str, Any]]
    has_more: bool


def new_conversation_id() -> str:
    return f"conv_{uuid.uuid4().hex}"


def _keys(conversation_id: str) -> ConversationKeys:
    """``conversation_id``'s keys; one not a conversation id names none."""
    if not CONVERSATION_ID.match(conversation_id):
        raise ConversationGone(conversation_id)
    return ConversationKeys(conversation_id)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ConversationStore:
    """Create, read, change and delete conversations and their items."""

    def __init__(
        self,
        client: AsyncClient,
        ttl_s: int = DEFAULT_TTL_S,
        max_items: int = DEFAULT_MAX_ITEMS,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if ttl_s < 0:
            raise ValueError("a conversation's TTL is 0 (none: kept until deleted) or more seconds")
        if max_items < 1 or max_bytes < 1:
            raise ValueError("a conversation's bounds are at least 1 item and 1 byte")
        self.client = client
        self.ttl_s, self.max_items, self.max_bytes = ttl_s, max_items, max_bytes
        self._write = client.register_script(WRITE_LUA)
        self._remove = client.register_script(REMOVE_LUA)

    async def create(
        self, metadata: Mapping[str, str], items: Sequence[Mapping[str, Any]], created_at: int
    ) -> Conversation:
        """A new conversation holding ``items`` (each with its ``id``)."""
        made = Conversation(new_conversation_id(), created_at, dict(metadata))
        await self._run(made.id, str(created_at), _dumps(made.metadata), items)
        return made

    async def get(self, conversation_id: str) -> Conversation | None:
        """The conversation ``conversation_id`` (None: no such conversation)."""
        if not CONVERSATION_ID.match(conversation_id):
            return None
        created_at, metadata = await self.client.hmget(
            ConversationKeys(conversation_id).meta, ["created_at", "metadata"])  # fmt: skip
        if created_at is None:
            return None
        return Conversation(conversation_id, int(created_at), json.loads(metadata or b"{}"))

    async def update(self, conversation_id: str, metadata: Mapping[str, str]) -> Conversation:
        """``conversation_id`` with its metadata replaced by ``metadata``."""
        await self._run(conversation_id, "", _dumps(dict(metadata)), ())
        found = await self.get(conversation_id)
        if found is None:  # deleted since
            raise ConversationGone(conversation_id)
        return found

    async def append(self, conversation_id: str, items: Sequence[Mapping[str, Any]]) -> None:
        """Append ``items`` (each with its ``id``), all or none."""
        await self._run(conversation_id, "", "", items)

    async def delete(self, conversation_id: str) -> bool:
        """Delete the conversation and its items; False where there was none."""
        if not CONVERSATION_ID.match(conversation_id):
            return False
        keys = _keys(conversation_id)
        existed = await self.client.exists(keys.meta)
        await self.client.delete(*keys.all)
        return bool(existed)

    async def items(self, conversation_id: str) -> list[dict[str, Any]] | None:
        """Every item, oldest first (None: no such conversation)."""
        if await self.get(conversation_id) is None:
            return None
        keys = _keys(conversation_id)
        return await self._read(keys, await self.client.zrange(keys.order, 0, -1))

    async def page(
        self, conversation_id: str, limit: int, *, desc: bool, after: str | None = None
    ) -> Page:
        """Up to ``limit`` items, newest first where ``desc``, from the one after ``after``
        (KeyError: no such item)."""
        keys = _keys(conversation_id)
        start = 0
        if after is not None:
            rank = await (self.client.zrevrank if desc else self.client.zrank)(keys.order, after)
            if not isinstance(rank, int):  # None: no such item
                raise KeyError(after)
            start = rank + 1
        ids = await self.client.zrange(keys.order, start, start + limit, desc=desc)
        return Page(await self._read(keys, ids[:limit]), len(ids) > limit)

    async def item(self, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        """One item (None: no such item)."""
        raw = await self.client.hget(_keys(conversation_id).items, item_id)
        return None if raw is None else dict(json.loads(raw))

    async def remove(self, conversation_id: str, item_id: str) -> bool:
        """Delete one item; False where the conversation holds none of that id."""
        try:
            return bool(await self._remove(_keys(conversation_id).all,
                                           [item_id, self.ttl_s]))  # fmt: skip
        except redis.ResponseError as exc:
            raise self._refusal(exc, conversation_id) from None

    async def _read(self, keys: ConversationKeys, ids: Sequence[Any]) -> list[dict[str, Any]]:
        """The items of ``ids``, in that order (one deleted since they were listed: left out)."""
        if not ids:
            return []
        raws = await self.client.hmget(keys.items, ids)
        return [json.loads(raw) for raw in raws if raw is not None]

    async def _run(
        self, conversation_id: str, created_at: str, metadata: str,
        items: Sequence[Mapping[str, Any]],
    ) -> None:  # fmt: skip
        keys = _keys(conversation_id)
        args: list[Any] = [created_at, metadata, self.ttl_s, self.max_items, self.max_bytes]
        for item in items:
            args += [item["id"], _dumps(item)]
        try:
            await self._write(keys.all, args)
        except redis.ResponseError as exc:
            raise self._refusal(exc, conversation_id) from None

    def _refusal(self, exc: redis.ResponseError, conversation_id: str) -> Exception:
        """The error a conversation script's error reply stands for (another: as it is)."""
        reason, _, detail = str(exc).partition(" ")
        if reason == "NOTFOUND":
            return ConversationGone(conversation_id)
        if reason == "DUPLICATE":
            return DuplicateItem(f"the conversation holds an item with id {detail!r} already")
        if reason == "TOOMANY":
            return ItemsRefused(f"the conversation would hold {detail} items: at most "
                                f"{self.max_items} here")  # fmt: skip
        if reason == "TOOBIG":
            return ItemsRefused(f"the conversation's items would hold {detail} bytes: at most "
                                f"{self.max_bytes} here")  # fmt: skip
        return exc
