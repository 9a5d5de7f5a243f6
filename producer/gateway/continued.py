"""A Responses API request with ``conversation`` (a conversation's id, or ``{"id": ...}``):
the conversation's items come before its input, and once it is answered its input items
and output items are appended to the conversation (``conversations.py``), before the
answer is sent: a response that cannot be added (the conversation full, or deleted
meanwhile) is answered with that error, not as if it had been.

A background one is added when it is settled (``background.py``): by the first gateway that
reads it final. Its items' ids are fixed by then, so a second gateway settling it at the
same time adds nothing (the conversation holds them); one the conversation cannot take
then (full, deleted) stays final and is not added: logged."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis

from .conversation_routes import conversation_not_found, stored_item
from .conversations import ConversationGone, DuplicateItem, ItemsRefused
from .errors import ApiError, invalid
from .replies import DOWN
from .state import Gateway
from .stored import Stored

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Continued:
    """The conversation a response continues, as it stood before it."""

    gateway: Gateway
    id: str
    items: list[dict[str, Any]]

    async def add(self, input: list[dict[str, Any]], output: list[dict[str, Any]]) -> None:
        """Append the response's input items (each with its id; after the conversation's
        own, which come first in ``input``) and its ``output``."""
        try:
            await self.gateway.conversations.append(self.id, self.added(input, output))
        except ConversationGone:
            raise conversation_not_found(self.id, "conversation") from None
        except ItemsRefused as exc:
            raise invalid(f"the response cannot be added to its conversation: {exc}",
                          "conversation") from None  # fmt: skip
        except (*DOWN, redis.ResponseError) as exc:
            raise ApiError(503, f"the response cannot be added to its conversation: {exc}",
                           code="unavailable") from None  # fmt: skip

    def added(self, input: list[dict[str, Any]], output: list[dict[str, Any]]) -> list[Any]:
        """The items the response adds: its own input items, and its output."""
        return [stored_item(item, item["id"]) for item in [*input[len(self.items) :], *output]]

    def pending(self) -> dict[str, Any]:
        """What a background response keeps (with its ``pending``) to be added once final."""
        return {"conversation": {"id": self.id, "after": len(self.items)}}


async def settled(gateway: Gateway, found: Stored, response: Mapping[str, Any]) -> None:
    """A background response made with ``conversation`` (``found``), final now as
    ``response``: added to the conversation (where it completed, or is incomplete)."""
    where = (found.pending or {}).get("conversation")
    if where is None or response["status"] not in ("completed", "incomplete"):
        return
    continued = Continued(gateway, where["id"], found.input[: where["after"]])
    try:
        await gateway.conversations.append(where["id"],
                                           continued.added(found.input, response["output"]))  # fmt: skip
    except DuplicateItem:  # another gateway settled it first
        return
    except (ConversationGone, ItemsRefused, *DOWN, redis.ResponseError) as exc:
        logger.warning("background response %s not added to conversation %s: %s",
                       response["id"], where["id"], exc)  # fmt: skip


def conversation_id(raw: Any) -> str:
    """``conversation``'s id: it is one, or ``{"id": ...}``."""
    if isinstance(raw, Mapping):
        raw = raw.get("id")
    if not isinstance(raw, str):
        raise invalid('conversation is a conversation id or {"id": <conversation id>}',
                      "conversation")  # fmt: skip
    return raw


async def continued(
    gateway: Gateway, body: Mapping[str, Any], new: list[dict[str, Any]]
) -> Continued:
    """The conversation ``body`` continues with the ``new`` input items: 404 where there is
    none; 400 with ``previous_response_id`` (OpenAI's rule), where a new item's id is one
    it holds, or where the new items alone would fill it."""
    if body.get("previous_response_id") is not None:
        raise invalid("Mutually exclusive parameters: Ensure you are only providing one of: "
                      "'previous_response_id' or 'conversation'.", "conversation")  # fmt: skip
    cid = conversation_id(body["conversation"])
    items = await gateway.conversations.items(cid)
    if items is None:
        raise conversation_not_found(cid, "conversation")
    held = {item["id"] for item in items}
    for i, item in enumerate(new):
        if item.get("id") in held:
            raise invalid(f"the conversation holds an item with id {item['id']!r} already",
                          f"input[{i}].id")  # fmt: skip
    most = gateway.conversations.max_items
    if len(items) + len(new) >= most:  # the output needs room too
        raise invalid(f"the conversation holds {len(items)} items, at most {most} here: "
                      "no room for this response", "conversation")  # fmt: skip
    return Continued(gateway, cid, items)
