"""vLLM's development routes that map onto a fleet (its ``VLLM_SERVER_DEV_MODE``; here
``--server-dev-mode``): ``POST /reset_prefix_cache``, a Celery broadcast
(``bf_reset_prefix_cache``) to every worker, each emptying its models' prefix caches.

vLLM resets its one model's cache; a gateway resets every model's, or the one named in
``?model=``. The answer is vLLM's, 200 with no body, where every worker that replied did
it (a worker without a prefix cache has nothing to empty); 500 where some refused (a
worker older than the command: each one's reason in the message); 503 where none of the
model's replied; 404 for a model no worker serves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...schemas.errors import BatchfleetError
from .app import Handler
from .errors import ApiError, of_exception
from .lora_admin import LoraAdmin

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
"""How long replies are awaited (emptying a cache is quick: the workers answer at once)."""


@dataclass(frozen=True, slots=True)
class DevAdmin(LoraAdmin):
    """What the routes need: the fleet's broker, broadcast to as the LoRA routes do."""

    timeout_s: float = DEFAULT_TIMEOUT_S


def reset_verdict(replies: Mapping[str, Any], model: str | None) -> None:
    """Nothing where every worker of ``model`` (None: every worker) that replied emptied
    its caches; else raises the :class:`ApiError` the module docstring lists."""
    mine = {h: r for h, r in replies.items() if isinstance(r, Mapping) and (
        "error" in r or (r.get("models") and (model is None or model in r["models"])))}  # fmt: skip
    if not mine:
        who = "worker" if model is None else f"worker of {model!r}"
        raise ApiError(503, f"no {who} replied (none answered in time): nothing was reset",
                       code="unavailable")  # fmt: skip
    refused = {h: r for h, r in mine.items() if "error" in r}
    if refused:
        reasons = "; ".join(f"{h}: {r['error']}" for h, r in sorted(refused.items()))
        done = ", ".join(sorted(set(mine) - set(refused))) or "none"
        raise ApiError(500, f"reset by {done} but not by the others: {reasons}",
                       code="partially_applied")  # fmt: skip


class ResetPrefixCache(Handler):
    """``POST /reset_prefix_cache`` (``?model=``: one model's)."""

    async def post(self) -> None:
        admin = self.gateway.dev_admin
        assert admin is not None  # the route exists only with it
        model = self.get_query_argument("model", None) or None
        try:
            if model is not None and model not in await self.gateway.models():
                raise ApiError(404, f"The model {model!r} does not exist: no worker serves it",
                               code="model_not_found", param="model")  # fmt: skip
            replies = await admin.broadcast("bf_reset_prefix_cache", {"model": model or ""})
            reset_verdict(replies, model)
        except ApiError as exc:
            return self.fail(exc)
        except BatchfleetError as exc:
            return self.fail(of_exception(exc))
        logger.info("prefix caches reset (%s) by %d workers", model or "every model", len(replies))
        self.set_status(200)
        self.finish()
