"""Every Redis key, stream, group and channel name batchfleet uses, built here alone.

All keys of one model share the hash tag ``{<model>}`` so that a model's streams,
results and dead letters live in one Redis Cluster slot and its Lua scripts stay
single-slot. See docs/protocol.md for the same table in prose.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

PREFIX = "bf"
GROUP = "workers"
"""The consumer group every worker of a model joins on each of its lane streams."""

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def check_model_name(model: str) -> str:
    """Return ``model`` if it is a legal model name, else raise ``ValueError``."""
    if not MODEL_NAME.match(model):
        raise ValueError(f"bad model name {model!r}: 1-64 chars of letters, digits, '_', '.', '-'")
    return model


LORA_UNLOADED = ""
"""The value of an adapter unloaded while the model serves in ``bf:{model}:lora`` (a
tombstone: never a directory, as those recorded are absolute)."""


@dataclass(frozen=True, slots=True)
class ModelKeys:
    """Names for one model's keys (all in the slot of ``{model}``)."""

    model: str

    def __post_init__(self) -> None:
        check_model_name(self.model)

    @property
    def tag(self) -> str:
        return f"{PREFIX}:{{{self.model}}}"

    def lane(self, lane: int) -> str:
        """The request stream of one priority lane (0 = highest)."""
        return f"{self.tag}:lane:{lane}"

    def lanes(self, count: int) -> list[str]:
        return [self.lane(i) for i in range(count)]

    def result(self, request_id: str) -> str:
        """The key holding a request's final result (with a TTL)."""
        return f"{self.tag}:result:{request_id}"

    def tokens(self, request_id: str) -> str:
        """A generating request's token stream: its deltas, then an end entry (result TTL)."""
        return f"{self.tag}:tokens:{request_id}"

    def started(self, request_id: str) -> str:
        """Set by the worker that admits generating request ``request_id`` (its prefill
        begins): its consumer name, with the result's TTL. Its absence says nothing (a
        worker older than the key, or not admitted yet)."""
        return f"{self.tag}:started:{request_id}"

    def cancel(self, request_id: str) -> str:
        """Set by a client (any value, with a TTL) to cancel request ``request_id``."""
        return f"{self.tag}:cancel:{request_id}"

    def input(self, name: str) -> str:
        """A blob a client wrote for a request to reference (an image too big to inline); the
        client sets it, with a TTL, before submitting; workers only read it."""
        return f"{self.tag}:input:{name}"

    def input_name(self, key: str) -> str | None:
        """The name of one of this model's input keys (as :meth:`input` builds it), else None."""
        name = key.removeprefix(f"{self.tag}:input:")
        return name if name != key and REQUEST_ID.match(name) else None

    @property
    def dead(self) -> str:
        """Dead-letter stream: entries that could not be answered, with the reason."""
        return f"{self.tag}:dead"

    @property
    def reclaim_lock(self) -> str:
        """Short lock: the one worker taking over dead workers' entries right now."""
        return f"{self.tag}:reclaim-lock"

    @property
    def max_depth(self) -> str:
        """A string holding the per-lane queue-depth limit (absent or 0: unbounded)."""
        return f"{self.tag}:max-depth"

    @property
    def limits(self) -> str:
        """A string holding the model's request limits as JSON (``max_inputs``,
        ``max_entry_bytes``, ...), written by workers for producers and gateways."""
        return f"{self.tag}:limits"

    @property
    def info(self) -> str:
        """A string holding what a client needs to know of the model as JSON (its task and
        context length: ``schemas/model_info.py``), written by workers for gateways."""
        return f"{self.tag}:info"

    @property
    def tokenizer(self) -> str:
        """A string holding the model's tokenizer configuration as JSON (vLLM's
        ``/tokenizer_info`` body: ``worker/tokenizer_info.py``), written by workers that
        have a tokenizer, for gateways."""
        return f"{self.tag}:tokenizer"

    @property
    def lora(self) -> str:
        """Hash of the LoRA adapters loaded and unloaded while the model serves
        (``bf_load_lora``, ``bf_unload_lora``): name → absolute adapter directory, or
        :data:`LORA_UNLOADED`; written by workers; a worker that starts loads the first and
        unloads the second (a fleet file's adapter too)."""
        return f"{self.tag}:lora"

    @property
    def workers(self) -> str:
        """Hash of consumers: name → unix ms of its last heartbeat (stale ones too, until
        their heartbeat is older than the ``dead_worker_retention_s`` of a live worker:
        it prunes them, ``worker/lua/prune.lua``)."""
        return f"{self.tag}:workers"

    @property
    def hostnames(self) -> str:
        """Hash of the model's workers' Celery hostnames: consumer name → hostname (where
        control broadcasts reach it), written with each heartbeat; a worker removes its
        entry as it stops, and the entries of workers whose heartbeat is older than the
        heartbeat timeout are pruned by the others (``worker/lua/prune.lua``)."""
        return f"{self.tag}:hostnames"

    @property
    def serving(self) -> str:
        """Hash of what each live worker serves the model with: consumer name → JSON
        (``schemas/model_info.py``'s ``WorkerServing``: its version, serving hash and
        ``heartbeat_timeout_ms``), for the gateway's fingerprint and the control commands'
        wait. Written with each heartbeat, removed as :attr:`hostnames`' entries are."""
        return f"{self.tag}:serving"

    @property
    def heartbeat_timeout(self) -> str:
        """A string holding the fleet's ``heartbeat_timeout_ms`` (past it, a worker whose
        heartbeat stopped is taken for dead), written by workers as they start (the last
        one's stands; each worker's own is in :attr:`serving`, read first), for the
        gateway's and the CLI's control commands: whom to wait for."""
        return f"{self.tag}:heartbeat_timeout_ms"

    @property
    def lanes_key(self) -> str:
        """A string holding the model's lane count, written by workers for producers."""
        return f"{self.tag}:lanes"

    def webhook_status(self, request_id: str) -> str:
        """JSON: where a request's webhook delivery stands (webhooks workers write it, with
        the result's TTL; the result itself never changes once stored)."""
        return f"{self.tag}:webhook:{request_id}"

    def lane_of(self, stream: str) -> int | None:
        """The lane number of one of this model's lane streams (as :meth:`lane` names it),
        else None: dead letters name their source stream."""
        head = f"{self.tag}:lane:"
        tail = stream.removeprefix(head)
        return int(tail) if tail != stream and tail.isdigit() and len(tail) < 4 else None


MODELS_KEY = f"{PREFIX}:models"
"""A set of the models some worker (or ``init-groups``) announced: what a fleet serves,
read without SCAN."""
LANES_KEY_PATTERN = f"{PREFIX}:{{*}}:lanes"
"""SCAN pattern matching every model's lanes key: the models a fleet serves (the way to
find them where the workers are too old to write ``MODELS_KEY``)."""


def model_names(members: Iterable[bytes | str]) -> list[str]:
    """The valid model names among ``MODELS_KEY``'s members, sorted."""
    names = (m.decode() if isinstance(m, bytes) else m for m in members)
    return sorted(n for n in names if MODEL_NAME.match(n))


def model_of_lanes_key(key: str) -> str | None:
    """The model whose lanes key this is (a match of ``LANES_KEY_PATTERN``), else None."""
    head, tail = f"{PREFIX}:{{", "}:lanes"
    if key.startswith(head) and key.endswith(tail):
        model = key[len(head) : -len(tail)]
        return model if MODEL_NAME.match(model) else None
    return None


def default_reply_channel(client_id: str) -> str:
    """The reply channel a Python producer subscribes to (one per producer)."""
    return f"{PREFIX}:reply:{client_id}"


WEBHOOK_QUEUE = "webhooks"
"""The Celery queue (a Redis list of that name) webhook delivery tasks travel on."""


@dataclass(frozen=True, slots=True)
class WebhookKeys:
    """Names of the webhook delivery keys (fleet-wide, not per model)."""

    prefix: str = f"{PREFIX}:webhooks"

    @property
    def scheduled(self) -> str:
        """Sorted set of deliveries waiting for their next attempt (every wait, short or long,
        so none is lost with a worker): member = JSON task arguments, score = due unix ms."""
        return f"{self.prefix}:scheduled"

    @property
    def failed(self) -> str:
        """Stream of failed deliveries (dead letters), for ``batchfleet webhooks list-failed``."""
        return f"{self.prefix}:failed"

    @property
    def disabled(self) -> str:
        """Hash of endpoints that answered 410 Gone: url → JSON reason. No more deliveries."""
        return f"{self.prefix}:disabled"

    def inflight(self, endpoint: str) -> str:
        """Sorted set of the deliveries in flight to one endpoint (``scheme://host:port``):
        member = attempt token, score = unix ms its lease ends (the per-endpoint cap)."""
        return f"{self.prefix}:{{{endpoint}}}:inflight"

    def slow(self, endpoint: str) -> str:
        """Present (with a TTL) while an endpoint's last attempt timed out: its cap is lowered."""
        return f"{self.prefix}:{{{endpoint}}}:slow"


RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_.:-]{1,128}$")
"""A Responses API response id: ``resp_`` and the fleet request id it answered."""
RESPONSE_KEY_PATTERN = f"{PREFIX}:responses:*"
"""Every stored response's key (the gateway's ACL pattern)."""


def response_key(response_id: str) -> str:
    """A stored Responses API response (JSON, with a TTL), that ``previous_response_id``
    continues and ``GET /v1/responses/{id}`` reads. Fleet-wide, untagged: each is read and
    written alone, so on a Cluster they spread over the slots rather than share one."""
    if not RESPONSE_ID.match(response_id):
        raise ValueError(f"bad response id {response_id!r}")
    return f"{PREFIX}:responses:{response_id}"


CONVERSATION_ID = re.compile(r"^conv_[A-Za-z0-9_-]{1,128}$")
"""A Conversations API conversation id: ``conv_`` and a random hex (the gateway's)."""
CONVERSATION_KEY_PATTERN = f"{PREFIX}:conversations:*"
"""Every conversation's keys (the gateway's ACL pattern)."""


@dataclass(frozen=True, slots=True)
class ConversationKeys:
    """Names of one Conversations API conversation's keys. They share the hash tag of its
    id, so its scripts stay single-slot on a Cluster, and conversations spread over slots."""

    conversation_id: str

    def __post_init__(self) -> None:
        if not CONVERSATION_ID.match(self.conversation_id):
            raise ValueError(f"bad conversation id {self.conversation_id!r}")

    @property
    def meta(self) -> str:
        """Hash: ``created_at``, ``metadata`` (JSON), ``next`` (the last item's sequence
        number) and ``bytes`` (its items' JSON, summed)."""
        return f"{PREFIX}:conversations:{{{self.conversation_id}}}"

    @property
    def items(self) -> str:
        """Hash: item id → the item's JSON."""
        return f"{self.meta}:items"

    @property
    def order(self) -> str:
        """Sorted set: item ids scored by their sequence number (the order they were added)."""
        return f"{self.meta}:order"

    @property
    def all(self) -> list[str]:
        """Every key, in the order the conversation scripts take them."""
        return [self.meta, self.items, self.order]
