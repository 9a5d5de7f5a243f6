"""One worker's handle on one model's Redis keys: the connection, the key names, its
consumer name and the Lua scripts, loaded here once for every operation module."""

from __future__ import annotations

import importlib.resources

from redis.commands.core import Script

from ..connection import SyncClient
from ..schemas.keys import ModelKeys


def _script(client: SyncClient, name: str) -> Script:
    source = importlib.resources.files(__package__).joinpath("lua").joinpath(name).read_text()
    return client.register_script(source)


class ModelRedis:
    """What every typed operation on a model's keys shares (the lane streams, the registry,
    the token streams, the published state: see :class:`~.streams.ModelStreams`)."""

    def __init__(self, client: SyncClient, model: str, lanes: int, consumer: str) -> None:
        self.client = client
        self.keys = ModelKeys(model)
        self.lanes = lanes
        self.consumer = consumer
        self.streams = self.keys.lanes(lanes)
        self._lane_of = {name.encode(): i for i, name in enumerate(self.streams)}
        self._finish = _script(client, "finish.lua")
        self._dead = _script(client, "dead_letter.lua")
        self._retire = _script(client, "retire.lua")
        self._refresh = _script(client, "refresh.lua")
        self._tokens = _script(client, "tokens.lua")
        self._prune = _script(client, "prune.lua")

    def redis_time(self) -> float:
        """Redis server clock in unix seconds."""
        sec, usec = self.client.time()
        return sec + usec / 1e6
