"""The gateway's readiness (``/health``) while Redis, or one master of a Redis Cluster, goes
silent (a hung network: :class:`~silent_network.SilentProxy`): 503 within a bound, not
after redis-py's socket timeouts and retries (a minute), and 200 again once it answers.
On a cluster every master is PINGed (its client's plain PING goes to one node). One PING
in flight at a time, whatever the number of probes."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import redis
from batchfleet.producer.gateway.readiness import READY_TIMEOUT_S, Readiness
from gateway_fakes import gateway_in_process, http
from hidden_cluster import HiddenCluster
from silent_network import SilentProxy

pytestmark = pytest.mark.timeout(180)

HUNG_GUARD_S = READY_TIMEOUT_S + 6
"""A probe of a silent Redis is answered within this (generous on a loaded machine), well
before redis-py's socket timeout (15 s), which an unbounded PING would wait out first."""
HEAL_GUARD_S = 30.0
"""Once healed, the gateway is ready again within this."""


# --- one PING in flight, bounded (a client whose PING the test answers) -----------------------


class HeldPings:
    """A client whose every PING waits until the test answers it (``answer``) or fails it;
    one may ignore its cancellation (``stubborn``), as redis-py's retries can."""

    def __init__(self, stubborn: bool = False) -> None:
        self.sent = 0
        self.stubborn = stubborn
        self.reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def ping(self) -> Any:
        self.sent += 1
        while True:
            try:
                return await asyncio.shield(self.reply) if self.stubborn else await self.reply
            except asyncio.CancelledError:
                if not self.stubborn or self.reply.done():
                    raise

    def answer(self, reply: Any = True) -> None:
        self.reply.set_result(reply)

    def fail(self, exc: Exception) -> None:
        self.reply.set_exception(exc)

    def again(self) -> None:
        """The next PING waits anew."""
        self.reply = asyncio.get_running_loop().create_future()


def test_probes_share_one_ping_and_its_answer() -> None:
    async def go() -> None:
        client = HeldPings()
        readiness = Readiness(client, timeout_s=30)  # type: ignore[arg-type]
        # Given five probes at once, while the PING is in flight
        probes = [asyncio.ensure_future(readiness.unready()) for _ in range(5)]
        await asyncio.sleep(0)
        # When it is answered, Then each is ready, one PING sent for them all
        client.answer()
        assert await asyncio.gather(*probes) == [None] * 5
        assert client.sent == 1
        # And a probe after it sends its own, whose error it reports
        client.again()
        later = asyncio.ensure_future(readiness.unready())
        await asyncio.sleep(0)
        client.fail(redis.ConnectionError("Connection refused"))
        assert await later == "Redis unreachable: Connection refused"
        assert client.sent == 2

    asyncio.run(asyncio.wait_for(go(), 10))


def test_a_ping_unanswered_within_the_bound_is_unready_and_not_repeated_while_in_flight() -> None:
    async def go() -> None:
        # Given a PING that keeps waiting, even once cancelled
        client = HeldPings(stubborn=True)
        readiness = Readiness(client, timeout_s=0.05)  # type: ignore[arg-type]
        probes = [asyncio.ensure_future(readiness.unready()) for _ in range(3)]
        # Then the probes waiting on it are unready once the bound has passed
        reasons = await asyncio.gather(*probes)
        assert reasons == ["Redis did not answer PING within 0.05 s"] * 3
        # And one arriving while it is still in flight is unready at once, no PING added
        assert await readiness.unready() == "Redis did not answer PING within 0.05 s"
        assert client.sent == 1
        # When it ends, Then the next probe PINGs anew, and is ready once answered
        client.answer()
        for _ in range(5):  # (its task's turns to end)
            await asyncio.sleep(0)
        client.stubborn = False
        client.again()
        probe = asyncio.ensure_future(readiness.unready())
        await asyncio.sleep(0)
        client.answer()
        assert await probe is None
        assert client.sent == 2

    asyncio.run(asyncio.wait_for(go(), 10))


# --- a real gateway ---------------------------------------------------------------------------


async def health(port: int) -> tuple[int, str]:
    """``/health``'s status and error message ("" on 200), within :data:`HUNG_GUARD_S`."""
    status, body = await asyncio.wait_for(http(port, "GET", "/health", key=None), HUNG_GUARD_S)
    return status, json.loads(body)["error"]["message"] if status != 200 else ""


async def ready_again(port: int) -> int:
    """Polls ``/health`` until it is 200 (or :data:`HEAL_GUARD_S` has passed): its status."""
    end = time.monotonic() + HEAL_GUARD_S
    while (status := (await health(port))[0]) != 200 and time.monotonic() < end:
        await asyncio.sleep(0.05)
    return status


async def unready_then_ready(port: int, proxy: SilentProxy) -> None:
    """Ready; unready within the bound (every probe of several at once) while ``proxy`` is
    silent, naming the unanswered PING; ready again once it passes on."""
    assert await health(port) == (200, "")
    proxy.silence()
    try:
        answers = await asyncio.gather(*(health(port) for _ in range(3)))
        assert answers == [(503, f"Redis did not answer PING within {READY_TIMEOUT_S:g} s")] * 3
    finally:
        proxy.heal()
    assert await ready_again(port) == 200


def test_health_of_a_single_redis_gone_silent_is_503_within_the_bound(redis_url: str) -> None:
    proxy = SilentProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))

    async def go() -> None:
        async with gateway_in_process(proxy.url()) as port:
            await unready_then_ready(port, proxy)

    try:
        asyncio.run(go())
    finally:
        proxy.close()


@pytest.mark.parametrize("master", [1, 2])
def test_health_on_a_cluster_is_503_within_the_bound_while_any_master_is_silent(
    master: int, hidden_cluster: HiddenCluster
) -> None:
    # Given a gateway on a cluster whose URL names the first master (its client's plain
    # PING goes there); When another master goes silent, Then it is unready, then ready
    async def go() -> None:
        async with gateway_in_process(hidden.url) as port:
            await unready_then_ready(port, hidden.proxies[master])

    with hidden_cluster.fresh() as hidden:
        asyncio.run(go())
