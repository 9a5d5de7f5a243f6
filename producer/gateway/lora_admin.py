"""vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on the gateway
(``--allow-runtime-lora-updating``; vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): the same
Celery broadcast as ``batchfleet load-lora`` and ``unload-lora``, to every worker, each of
the base model's answering for itself.

vLLM serves one base model; a gateway serves several, so the body may name the base in
``model`` (needed where the fleet serves more than one generation model). The answer is
vLLM's: 200 with ``Success: LoRA adapter 'NAME' added successfully.`` (``removed``) as
text where every worker of the model that replied did it; 400 where they all refused
(already loaded, a directory they cannot read, an adapter they do not serve), 404 where
unloading one none of them has; 500 where some did and some refused (the workers' reasons,
each named, in the message); 503 where no worker of the model replied.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...remote import send_to_all
from ...schemas.errors import BatchfleetError
from .app import Gateway, Handler
from .errors import ApiError, invalid, of_exception

GENERATION = "text-generation"
"""The task of the models that serve LoRA adapters (their ``bf:{model}:info``)."""
DEFAULT_TIMEOUT_S = 30.0
"""How long replies are awaited (reading an adapter takes a while: ``load-lora``'s)."""

Send = Callable[..., dict[str, Any]]
""":func:`~batchfleet.remote.send_to_all`'s signature: broker, command, arguments."""


@dataclass(frozen=True, slots=True)
class LoraAdmin:
    """What the routes need: the fleet's broker (where workers listen for broadcasts)."""

    broker_url: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    send: Send = send_to_all

    async def broadcast(self, command: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Hostname → reply of every worker that answered (off the event loop: it blocks);
        a 503 where the broker cannot be reached or refuses (its ACL user)."""
        try:
            return await asyncio.to_thread(self.send, self.broker_url, command, arguments,
                                           timeout=self.timeout_s)  # fmt: skip
        except Exception as exc:  # kombu's and redis' errors alike: the broker's side
            raise ApiError(503, f"the broker failed: {type(exc).__name__}: {exc}",
                           code="unavailable") from None  # fmt: skip


def verdict(replies: Mapping[str, Any], base: str, name: str, load: bool) -> str:
    """The success text where every worker of ``base`` that replied did it; else raises
    the :class:`ApiError` the module docstring lists."""
    mine = {h: r for h, r in replies.items()
            if isinstance(r, Mapping) and ("error" in r or base in r.get("models", ()))}  # fmt: skip
    if not mine:
        raise ApiError(503, f"no worker of {base!r} replied (none serves it, or none answered "
                            "in time): nothing changed", code="unavailable")  # fmt: skip
    done = sorted(h for h, r in mine.items() if "error" not in r)
    refused = {h: r for h, r in mine.items() if "error" in r}
    codes = {r.get("code", "refused") for r in refused.values()}
    if not load and codes == {"not_loaded"}:
        if done:  # gone from every worker (some had not loaded it)
            refused = {}
        else:
            raise ApiError(404, f"The lora adapter {name!r} cannot be found.",
                           code="not_found", param="lora_name")  # fmt: skip
    if not refused:
        return f"Success: LoRA adapter {name!r} {'added' if load else 'removed'} successfully."
    reasons = "; ".join(f"{h}: {r['error']}" for h, r in sorted(refused.items()))
    if not done:
        if codes == {"already_loaded"}:
            reasons = f"The lora adapter {name!r} has already been loaded. ({reasons})"
        raise invalid(reasons, "lora_name" if codes == {"already_loaded"} else None)
    did = "loaded" if load else "unloaded"
    raise ApiError(500, f"{did} by {', '.join(done)} but not by the others: {reasons}",
                   code="partially_applied")  # fmt: skip


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
            replies = await admin.broadcast(command, arguments | {"model": base})
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
