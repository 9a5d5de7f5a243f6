"""vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on the gateway
(``--allow-runtime-lora-updating``; vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): the same
Celery broadcast as ``batchfleet load-lora`` and ``unload-lora``, to every worker, each of
the base model's answering for itself.

vLLM serves one base model; a gateway serves several, so the body may name the base in
``model`` (needed where the fleet serves more than one generation model). The answer is
vLLM's: 200 with ``Success: LoRA adapter 'NAME' added successfully.`` (``removed``) as
text where every live worker of the model (``fleet_control.py``) did it; 400 where they
all refused (already loaded, a directory they cannot read, an adapter they do not serve),
404 where unloading one none of them has; 500 where some did and some refused (the
workers' reasons, each named, in the message); 504 where some did not reply in time
(named in ``missing_workers``; they may still do it); 503 where no worker of the model is
live.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...control_wait import Replies
from ...schemas.errors import BatchfleetError
from .errors import ApiError, invalid, of_exception
from .fleet_control import ControlAdmin, late, partial
from .handler import Handler
from .state import Gateway

GENERATION = "text-generation"
"""The task of the models that serve LoRA adapters (their ``bf:{model}:info``)."""


@dataclass(frozen=True, slots=True)
class LoraAdmin(ControlAdmin):
    """What the routes need: the fleet's broker, and how long replies are awaited."""


def verdict(replies: Replies, base: str, name: str, load: bool) -> str:
    """The success text where every live worker of ``base`` did it; else raises the
    :class:`ApiError` the module docstring lists."""
    mine = replies.mine(lambda r: base in r.get("models", ()))
    done = sorted(h for h, r in mine.items() if "error" not in r)
    refused = {h: r for h, r in mine.items() if "error" in r}
    codes = {r.get("code", "refused") for r in refused.values()}
    if not load and codes == {"not_loaded"} and done:
        refused = {}  # gone from every worker that replied (some had not loaded it)
    did = "loaded" if load else "unloaded"
    if replies.missing and not (done and refused):
        raise late(replies, f"{did} by {', '.join(done) or 'none'}"
                           + "".join(f"; refused by {h}: {r['error']}"
                                     for h, r in sorted(refused.items())))  # fmt: skip
    if not mine:
        raise ApiError(503, f"no worker of {base!r} is live (none has a recent heartbeat): "
                            "nothing changed", code="unavailable")  # fmt: skip
    if refused and codes == {"not_loaded"} and not load:
        raise ApiError(404, f"The lora adapter {name!r} cannot be found.",
                       code="not_found", param="lora_name")  # fmt: skip
    if not refused:
        return f"Success: LoRA adapter {name!r} {'added' if load else 'removed'} successfully."
    reasons = "; ".join(f"{h}: {r['error']}" for h, r in sorted(refused.items()))
    if not done:
        if codes == {"already_loaded"}:
            reasons = f"The lora adapter {name!r} has already been loaded. ({reasons})"
        raise invalid(reasons, "lora_name" if codes == {"already_loaded"} else None)
    raise partial(replies, f"{did} by {', '.join(done)} but not by the others: {reasons}")


class LoraRoute(Handler):
    """``POST /v1/load_lora_adapter`` (``load``) or ``/v1/unload_lora_adapter``."""

    def initialize(self, gateway: Gateway, load: bool) -> None:  # type: ignore[override]
        super().initialize(gateway)
        self.load = load

    async def post(self) -> None:
        admin = self.gateway.lora_admin
        assert admin is not None  # the routes exist only with it
        try:
            body = self.body_json()
            name = _field(body, "lora_name")
            arguments = {"name": name}
            if self.load:
                arguments["path"] = _field(body, "lora_path", 4096)
            base = await self._base(body.get("model"))
            command = "bf_load_lora" if self.load else "bf_unload_lora"
            expect = await admin.live(self.gateway.producer.client, [base])
            replies = await admin.broadcast(command, arguments | {"model": base}, expect)
            self.gateway.forget_info(base)  # its workers published it again
            text = verdict(replies, base, name, self.load)
        except ApiError as exc:
            return self.fail(exc)
        except BatchfleetError as exc:
            return self.fail(of_exception(exc))
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(text)

    async def _base(self, model: Any) -> str:
        """The base model: ``model``, or the one generation model the fleet serves."""
        served = await self.gateway.models()
        if model is not None:
            if not isinstance(model, str) or model not in served:
                raise ApiError(404, f"The model {model!r} does not exist: no worker serves it "
                               "(name the base model, not an adapter)", code="model_not_found",
                               param="model")  # fmt: skip
            return model
        infos = await asyncio.gather(*(self.gateway.model_info(m) for m in served))
        bases = [m for m, i in zip(served, infos, strict=True) if i is None or i.task == GENERATION]
        if len(bases) == 1:
            return bases[0]
        if not bases:
            raise ApiError(404, "no generation model is served", code="model_not_found",
                           param="model")  # fmt: skip
        raise invalid(f"this gateway serves several generation models ({', '.join(bases)}): "
                      "name the base model in `model`", "model")  # fmt: skip


def _field(body: Mapping[str, Any], key: str, longest: int = 128) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= longest:
        raise invalid(f"`{key}` must be a string of 1-{longest} characters", key)
    return value
