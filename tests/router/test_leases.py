"""Node leases: one request per node, FIFO waiting bounded by the timeout, no leaks."""

from __future__ import annotations

import asyncio

import pytest

from tilepd.contracts.service_configs import DecodeEndpoint
from tilepd.router.leases import LeaseTimeout, NodePool, NoNodeInRotation


def _pool(n: int) -> NodePool:
    pool = NodePool.of(tuple(DecodeEndpoint(name=f"d{i}", host="127.0.0.1", ctrl_port=1, http_port=2) for i in range(n)))
    for node in pool.nodes:
        pool.set_in_rotation(node, True)
    return pool


def test_one_lease_per_node_and_fifo_hand_over() -> None:
    async def main() -> None:
        pool = _pool(1)
        first = await pool.acquire(1.0)
        order: list[int] = []

        async def waiter(i: int) -> None:
            lease = await pool.acquire(5.0)
            order.append(i)
            await asyncio.sleep(0.01)
            lease.release()

        tasks = [asyncio.create_task(waiter(i)) for i in range(5)]
        await asyncio.sleep(0.05)
        assert pool.queue_depth == 5 and order == []
        first.release()
        first.release()  # idempotent: must not free the node a second time
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4]
        assert pool.leased_count() == 0 and pool.queue_depth == 0

    asyncio.run(main())


def test_wait_is_bounded_and_leaves_no_waiter_behind() -> None:
    async def main() -> None:
        pool = _pool(1)
        held = await pool.acquire(1.0)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(LeaseTimeout):
            await pool.acquire(0.2)
        assert 0.19 <= asyncio.get_running_loop().time() - t0 < 1.0
        assert pool.queue_depth == 0
        held.release()
        assert pool.leased_count() == 0
        again = await pool.acquire(0.1)
        assert again.waited_s < 0.05

    asyncio.run(main())


def test_cancelled_waiter_does_not_swallow_the_node() -> None:
    async def main() -> None:
        pool = _pool(1)
        held = await pool.acquire(1.0)
        waiting = asyncio.create_task(pool.acquire(5.0))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.sleep(0)
        held.release()
        lease = await pool.acquire(0.1)  # the node went to nobody else
        lease.release()
        assert pool.leased_count() == 0

    asyncio.run(main())


def test_many_concurrent_requests_two_nodes_never_double_lease() -> None:
    async def main() -> None:
        pool = _pool(2)
        busy: set[str] = set()
        outcomes: list[str] = []

        async def one() -> None:
            try:
                lease = await pool.acquire(0.3)
            except LeaseTimeout:
                outcomes.append("timeout")
                return
            assert lease.node.name not in busy
            busy.add(lease.node.name)
            await asyncio.sleep(0.05)
            busy.discard(lease.node.name)
            lease.release()
            outcomes.append("ok")

        await asyncio.gather(*(one() for _ in range(20)))
        assert len(outcomes) == 20 and "ok" in outcomes and "timeout" in outcomes
        assert pool.leased_count() == 0 and pool.queue_depth == 0

    asyncio.run(main())


def test_breaker_takes_nodes_out_and_back() -> None:
    async def main() -> None:
        pool = _pool(1)
        node = pool.nodes[0]
        held = await pool.acquire(1.0)
        waiting = asyncio.create_task(pool.acquire(5.0))
        await asyncio.sleep(0.01)
        pool.set_in_rotation(node, False)  # the last node fails: waiters fail over at once
        with pytest.raises(NoNodeInRotation):
            await waiting
        held.release()
        with pytest.raises(NoNodeInRotation):
            await pool.acquire(1.0)
        pool.set_in_rotation(node, True)
        lease = await pool.acquire(0.1)
        assert lease.node is node
        lease.release()

    asyncio.run(main())


def test_a_stream_with_nowhere_else_to_go_waits_for_a_node_to_come_back() -> None:
    """Mid-stream, no native pool, no node in rotation (the only one was silent for a while): the request waits,
    bounded, for a node to answer its health checks again; plain `acquire` gives up at once."""
    async def main() -> None:
        pool = _pool(2)
        for node in pool.nodes:
            pool.set_in_rotation(node, False)
        with pytest.raises(NoNodeInRotation):
            await pool.acquire(5.0)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(LeaseTimeout, match="came back"):
            await pool.acquire_when_back(0.2)
        assert 0.19 <= asyncio.get_running_loop().time() - t0 < 1.0 and pool.queue_depth == 0

        waiting = asyncio.create_task(pool.acquire_when_back(5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        pool.set_in_rotation(pool.nodes[1], True)
        pool.set_draining(pool.nodes[1], True)  # back, but draining: still nothing to lease
        await asyncio.sleep(0.05)
        assert not waiting.done()
        pool.set_draining(pool.nodes[1], False)
        lease = await asyncio.wait_for(waiting, 1.0)
        assert lease.node is pool.nodes[1] and pool.leased_count() == 1
        lease.release()
        assert pool.leased_count() == 0 and pool.queue_depth == 0

    asyncio.run(main())


def test_background_work_never_takes_a_node_another_router_holds() -> None:
    """The divergence watch's probes lease with `try_lease`: a node whose reservation another router holds stays
    untouched until the node says its slot is free."""
    async def main() -> None:
        pool = _pool(1)
        node = pool.nodes[0]
        lease = pool.try_lease(node)
        assert lease is not None
        lease.abandon("router-b (elsewhere:8000, pid 7)")  # the node answered busy to our reservation
        assert node.held_by is not None and pool.try_lease(node) is None
        pool.back_from_elsewhere(node)
        again = pool.try_lease(node)
        assert again is not None and node.held_by is None
        again.release()

    asyncio.run(main())
