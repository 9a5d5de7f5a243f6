"""vLLM's development routes that map onto a fleet (its ``VLLM_SERVER_DEV_MODE``; here
``--server-dev-mode``): ``POST /reset_prefix_cache``, a Celery broadcast
(``bf_reset_prefix_cache``) to every worker, each emptying its models' prefix caches.

vLLM resets its one model's cache; a gateway resets every model's, or the one named in
``?model=``. The answer is vLLM's, 200 with no body, where every live worker of the model
(of any model) did it (``fleet_control.py``; a worker without a prefix cache has nothing
to empty); 500 where some refused (a worker older than the command: each one's reason in
the message); 504 where some did not reply in time (named in ``missing_workers``); 503
where none of the model's is live; 404 for a model no worker serves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...control_wait import Replies
from ...schemas.errors import BatchfleetError
from .errors import ApiError, of_exception
from .fleet_control import ControlAdmin, late, partial
from .handler import Handler

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DevAdmin(ControlAdmin):
    """What the routes need: the fleet's broker, broadcast to as the LoRA routes do."""


def reset_verdict(replies: Replies, model: str | None) -> None:
    """Nothing where every live worker of ``model`` (None: every worker) emptied its
    caches; else raises the :class:`ApiError` the module docstring lists."""
    mine = replies.mine(lambda r: bool(r.get("models")) and model in (None, *r["models"]))
    refused = {h: r for h, r in mine.items() if "error" in r}
    done = ", ".join(sorted(set(mine) - set(refused))) or "none"
    reasons = "; ".join(f"{h}: {r['error']}" for h, r in sorted(refused.items()))
    if refused:
        raise partial(replies, f"reset by {done} but not by the others: {reasons}")
    if replies.missing:
        raise late(replies, f"reset by {done}")
    if not mine:
        who = "worker" if model is None else f"worker of {model!r}"
        raise ApiError(503, f"no {who} is live (none has a recent heartbeat): nothing was "
                            "reset", code="unavailable")  # fmt: skip


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
            served = [model] if model is not None else await self.gateway.models()
            expect = await admin.live(self.gateway.producer.client, served)
            replies = await admin.broadcast("bf_reset_prefix_cache", {"model": model or ""},
                                            expect)  # fmt: skip
            reset_verdict(replies, model)
        except ApiError as exc:
            return self.fail(exc)
        except BatchfleetError as exc:
            return self.fail(of_exception(exc))
        logger.info(
            "prefix caches reset (%s) by %d workers", model or "every model", len(replies.got)
        )
        self.set_status(200)
        self.finish()
