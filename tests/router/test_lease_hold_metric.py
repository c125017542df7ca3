"""The lease-hold histogram by busy level: each release recorded at the number of nodes leased when it was granted."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tilepd.plan.service_configs import DecodeEndpoint
from tilepd.router.leases import NodePool
from tilepd.router.metrics import BUSY_LABEL_CAP, RouterMetrics, busy_label


def _pool(n: int) -> tuple[NodePool, RouterMetrics]:
    pool = NodePool.of(tuple(DecodeEndpoint(name=f"d{i}", host="127.0.0.1", ctrl_port=1, http_port=2) for i in range(n)))
    for node in pool.nodes:
        pool.set_in_rotation(node, True)
    return pool, RouterMetrics(pool, breaker_failures=3)


def _counts(m: RouterMetrics) -> tuple[float, dict[str, float]]:
    """(count of the unlabelled hold histogram, {busy label: count of the labelled one})."""
    total, by_busy = 0.0, {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name == "tilepd_router_lease_hold_seconds_count":
                total = s.value
            elif s.name == "tilepd_router_lease_hold_by_busy_seconds_count":
                by_busy[s.labels["busy"]] = s.value
    return total, by_busy


def test_busy_label_is_capped() -> None:
    assert [busy_label(k) for k in (0, 1, 2, BUSY_LABEL_CAP - 1)] == ["1", "1", "2", str(BUSY_LABEL_CAP - 1)]
    assert busy_label(BUSY_LABEL_CAP) == busy_label(10 * BUSY_LABEL_CAP) == f"{BUSY_LABEL_CAP}+"


def test_hold_recorded_at_the_busy_level_of_the_grant() -> None:
    async def main() -> None:
        pool, m = _pool(3)
        a = await pool.acquire(1.0)  # alone: busy 1
        b = await pool.acquire(1.0)  # next to a: busy 2
        c = await pool.acquire(1.0)  # busy 3
        assert (a.busy, b.busy, c.busy) == (1, 2, 3)
        waiter = asyncio.create_task(pool.acquire(5.0))
        await asyncio.sleep(0.01)
        a.release()  # handed to the waiter: b and c still held, so it is granted at busy 3
        d = await waiter
        assert d.busy == 3
        for lease in (b, c, d):
            lease.release()
        e = await pool.acquire(1.0)  # the pool is empty again
        assert e.busy == 1
        e.release()
        e.release()  # idempotent: recorded once
        total, by_busy = _counts(m)
        assert total == 5 == sum(by_busy.values())  # the unlabelled total stays every lease
        assert by_busy == {"1": 2, "2": 1, "3": 2}

    asyncio.run(main())


def test_large_pool_shares_one_top_label() -> None:
    async def main() -> None:
        pool, m = _pool(BUSY_LABEL_CAP + 3)
        leases = [await pool.acquire(1.0) for _ in range(BUSY_LABEL_CAP + 3)]
        for lease in leases:
            lease.release()
        _, by_busy = _counts(m)
        assert by_busy[f"{BUSY_LABEL_CAP}+"] == 4 and len(by_busy) == BUSY_LABEL_CAP

    asyncio.run(main())
