"""A timeout measured while the router's own loop was held up is not held against a decode node
(tilepd/router/loop_lag.py): a health check that timed out across the router's stall counts neither way (up to
MAX_UNJUDGED in a row); one that timed out while the router ran counts as a failure. Real sockets: the node is a
listener that accepts and never answers; the stall is the router's loop really blocked."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from tilepd.contracts.service_configs import DecodeEndpoint
from tilepd.router.health import MAX_UNJUDGED, probe_node
from tilepd.router.leases import NodePool
from tilepd.router.loop_lag import INCONCLUSIVE_SHARE, LoopLag
from tilepd.router.metrics import RouterMetrics
from tilepd.router.upstream import Upstream

PROBE_TIMEOUT_S = 0.5


def test_hold_ups_are_summed_from_an_instant_including_one_under_way() -> None:
    lag = LoopLag(tick_s=0.1, threshold_s=0.25)
    lag._last = 100.0
    lag.note(100.1)  # on time
    lag.note(102.2)  # held up from 100.2 to 102.2
    lag.note(102.35)  # 0.05 s late: under the threshold, not a hold-up
    assert lag.stalled_s(99.0, now=102.4) == pytest.approx(2.0)
    assert lag.stalled_s(101.2, now=102.4) == pytest.approx(1.0)  # only the part after the instant
    assert lag.stalled_s(102.3, now=102.4) == 0.0
    # no tick since 102.35: at 105.45 the loop has been held up since the tick due at 102.45
    assert lag.stalled_s(102.3, now=105.45) == pytest.approx(3.0)
    assert not lag.judges(102.3, 3.15, now=105.45) and lag.judges(99.0, 20.0, now=102.4)


async def _never_answering(asked: asyncio.Event) -> tuple[asyncio.Server, int]:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)  # the request; no answer, ever
        asked.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # the test is over
            writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _state(port: int) -> SimpleNamespace:
    """The parts of a router's state a health check uses, all real but the config holder."""
    pool = NodePool.of((DecodeEndpoint(name="d0", host="127.0.0.1", ctrl_port=1, http_port=port),))
    pool.set_in_rotation(pool.nodes[0], True)
    return SimpleNamespace(client=Upstream(connect_timeout_s=2.0, read_timeout_s=60.0), config=SimpleNamespace(health_timeout_s=PROBE_TIMEOUT_S),
                           pool=pool, metrics=RouterMetrics(pool, breaker_failures=1), loop_lag=LoopLag())


def test_a_probe_timed_out_across_the_routers_own_stall_is_not_held_against_the_node(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        asked = asyncio.Event()
        server, port = await _never_answering(asked)
        state = _state(port)
        node = state.pool.nodes[0]
        watch = asyncio.create_task(state.loop_lag.run())

        async def probe_across_a_stall() -> None:
            asked.clear()
            probe = asyncio.create_task(probe_node(state, node))
            await asyncio.wait_for(asked.wait(), 30)  # the request is out, the answer awaited
            time.sleep(PROBE_TIMEOUT_S + 1.0)  # the router's loop held up past the probe's timeout
            await probe

        try:
            for i in range(MAX_UNJUDGED):
                await probe_across_a_stall()
                assert node.unjudged_probes == i + 1 and node.consecutive_failures == 0 and node.in_rotation, (i, node)
            # the next timed-out check across a stall counts: a router always held up still takes a dead node out
            await probe_across_a_stall()
            assert node.consecutive_failures == 1 and not node.in_rotation and node.unjudged_probes == 0, node
            # and with the router running all along, a timeout is the node's (a longer check: on a loaded test box
            # the loop may lag a little by itself, and a quarter of 2 s of lag would make it inconclusive)
            # the test cannot stop another job on the box from holding its loop up: a check the loop lag made
            # inconclusive by the rule (over INCONCLUSIVE_SHARE of the timeout) is tried again, bounded; the first one
            # with the loop running must count against the node
            state.config.health_timeout_s = 2.0
            tries: list[float] = []
            while len(tries) < 5:
                state.pool.set_in_rotation(node, True)
                node.consecutive_failures = node.unjudged_probes = 0
                started = time.monotonic()
                await probe_node(state, node)
                tries.append(state.loop_lag.stalled_s(started))
                if tries[-1] < INCONCLUSIVE_SHARE * state.config.health_timeout_s:
                    break
                assert node.unjudged_probes == 1 and node.consecutive_failures == 0, (node, tries)
            assert tries[-1] < INCONCLUSIVE_SHARE * state.config.health_timeout_s, f"the loop lagged on every try: {tries}"
            assert node.consecutive_failures == 1 and not node.in_rotation and node.unjudged_probes == 0, (node, tries)
            retried.append(len(tries) - 1)
        finally:
            watch.cancel()
            server.close()
            await state.client.aclose()

    retried: list[int] = []
    with caplog.at_level(logging.WARNING, logger="tilepd.router"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "event=probe_inconclusive" in r.getMessage()]
    assert len(lines) == MAX_UNJUDGED + retried[0] and "node=d0 router_held_up_s=" in lines[0], lines
    assert all(float(line.split("router_held_up_s=")[1].split()[0]) >= 1.0 for line in lines[:MAX_UNJUDGED]), lines
