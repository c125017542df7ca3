"""Leases of draining nodes: never leased, the held one finishes without a watchdog trip, back on undrain."""

from __future__ import annotations

import asyncio

import pytest

from tilepd.contracts.service_configs import DecodeEndpoint
from tilepd.router.health import says_draining
from tilepd.router.leases import NodePool, NoNodeInRotation
from tilepd.router.upstream import UpstreamResponse


def _pool(n: int) -> NodePool:
    pool = NodePool.of(tuple(DecodeEndpoint(name=f"d{i}", host="127.0.0.1", ctrl_port=1, http_port=2) for i in range(n)))
    for node in pool.nodes:
        pool.set_in_rotation(node, True)
    return pool


def test_a_draining_node_is_not_leased_and_comes_back_on_undrain() -> None:
    async def main() -> None:
        pool = _pool(2)
        d0, d1 = pool.nodes
        held = await pool.acquire(1.0)
        assert held.node is d0
        assert pool.set_draining(d0, True) and not pool.set_draining(d0, True)  # a second drain changes nothing
        # the held request is not told to leave: draining is not a fault (its watchdog reads left_rotation)
        assert d0.in_rotation and not d0.left_rotation.is_set()
        assert pool.in_rotation() == [d1]
        other = await pool.acquire(1.0)
        assert other.node is d1
        waiter = asyncio.create_task(pool.acquire(5.0))
        await asyncio.sleep(0.05)
        held.release()  # the draining node is free now: not handed to the waiter
        await asyncio.sleep(0.05)
        assert not waiter.done() and not d0.leased
        pool.set_draining(d0, False)  # undrained: serves the waiter at once
        again = await asyncio.wait_for(waiter, 1.0)
        assert again.node is d0 and pool.in_rotation() == [d0, d1]
        again.release()
        other.release()

    asyncio.run(main())


def test_when_every_node_drains_waiters_fail_over_at_once() -> None:
    async def main() -> None:
        pool = _pool(1)
        held = await pool.acquire(1.0)
        waiter = asyncio.create_task(pool.acquire(30.0))
        await asyncio.sleep(0.05)
        pool.set_draining(pool.nodes[0], True)
        with pytest.raises(NoNodeInRotation):
            await asyncio.wait_for(waiter, 1.0)
        with pytest.raises(NoNodeInRotation):
            await pool.acquire(30.0)
        held.release()
        assert pool.queue_depth == 0 and not pool.nodes[0].leased

    asyncio.run(main())


def test_only_a_503_that_says_draining_is_a_drain() -> None:
    def resp(status: int, body: bytes) -> UpstreamResponse:
        return UpstreamResponse(status, {}, body)

    assert says_draining(resp(503, b'{"status": "draining", "idle": false}'))
    assert not says_draining(resp(503, b'{"status": "starting"}'))
    assert not says_draining(resp(503, b'{"status": "unhealthy", "reason": "rank 1 died"}'))
    assert not says_draining(resp(200, b'{"status": "draining"}'))
    assert not says_draining(resp(503, b"<html>proxy error</html>"))
    assert not says_draining(resp(503, b'["draining"]'))
