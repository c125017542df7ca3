"""The pool as a birth-death chain in /metrics: seconds at each busy level and the releases made there, exact on a
hand-stepped clock through the real pool's leases, hand-overs and the router's own rendering."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.capacity.helpers import ManualClock, PoolDriver, router_metrics
from tilepd.router.metrics import BUSY_LABEL_CAP, RouterMetrics, busy_label


def _levels(m: RouterMetrics) -> dict[str, dict[str, float]]:
    """{family: {busy label: value}} for the three busy-level counters, and the hold histogram's count."""
    out: dict[str, dict[str, float]] = {"seconds": {}, "node_seconds": {}, "releases": {}, "holds": {}}
    names = {"tilepd_router_pool_busy_seconds_total": "seconds", "tilepd_router_pool_busy_node_seconds_total": "node_seconds",
             "tilepd_router_pool_releases_total": "releases"}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name in names:
                out[names[s.name]][s.labels["busy"]] = s.value
            elif s.name == "tilepd_router_lease_hold_seconds_count":
                out["holds"]["all"] = s.value
    return out


def test_busy_label_is_capped() -> None:
    assert [busy_label(k) for k in (0, 1, 2, BUSY_LABEL_CAP - 1)] == ["0", "1", "2", str(BUSY_LABEL_CAP - 1)]
    assert busy_label(BUSY_LABEL_CAP) == busy_label(10 * BUSY_LABEL_CAP) == f"{BUSY_LABEL_CAP}+"


def test_time_and_releases_at_each_level_including_a_hand_over() -> None:
    clock = ManualClock()
    m, pool = router_metrics(nodes=3, clock=clock)

    async def main() -> None:
        clock.advance(5.0)  # idle
        a = await pool.acquire(1.0)
        clock.advance(1.0)  # 1 busy
        b = await pool.acquire(1.0)
        clock.advance(2.0)  # 2 busy
        c = await pool.acquire(1.0)
        waiter = asyncio.create_task(pool.acquire(5.0))
        await asyncio.sleep(0)
        clock.advance(3.0)  # 3 busy, one waiting
        a.release()  # handed straight to the waiter: a release from 3, the pool stays at 3
        d = await waiter
        assert d.waited_s == pytest.approx(3.0)
        clock.advance(0.5)
        b.release()  # from 3
        clock.advance(0.25)
        c.release()  # from 2
        d.release()  # from 1, at once
        d.release()  # idempotent
        clock.advance(4.0)

    asyncio.run(main())
    got = _levels(m)
    assert got["seconds"] == pytest.approx({"0": 9.0, "1": 1.0, "2": 2.25, "3": 3.5})
    assert got["node_seconds"] == pytest.approx({"0": 0.0, "1": 1.0, "2": 4.5, "3": 10.5})
    assert got["releases"] == {"3": 2, "2": 1, "1": 1}
    assert got["holds"]["all"] == 4  # every lease's hold, once


def test_a_steady_level_gives_its_mean_service_time() -> None:
    clock = ManualClock()
    m, pool = router_metrics(nodes=2, clock=clock)
    driver = PoolDriver(m, pool, clock)
    driver.at_level(1, releases=40, hold_s=0.1)
    driver.at_level(2, releases=60, hold_s=0.3)
    got = _levels(m)
    assert got["node_seconds"]["1"] / got["releases"]["1"] == pytest.approx(0.1)
    assert got["node_seconds"]["2"] / got["releases"]["2"] == pytest.approx(0.3)


def test_large_pool_shares_one_top_label() -> None:
    clock = ManualClock()
    m, pool = router_metrics(nodes=BUSY_LABEL_CAP + 3, clock=clock)

    async def main() -> None:
        leases = []
        for _ in range(BUSY_LABEL_CAP + 3):
            leases.append(await pool.acquire(1.0))
            clock.advance(1.0)
        for lease in leases:
            lease.release()

    asyncio.run(main())
    got = _levels(m)
    top = f"{BUSY_LABEL_CAP}+"
    assert len(got["seconds"]) == BUSY_LABEL_CAP + 1 and got["seconds"][top] == pytest.approx(4.0)
    assert got["node_seconds"][top] == pytest.approx(sum(range(BUSY_LABEL_CAP, BUSY_LABEL_CAP + 4)))
    assert got["releases"][top] == 4


def _alone(m: RouterMetrics) -> tuple[float, float, float]:
    got: dict[str, float] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name.startswith("tilepd_router_pool_alone_"):
                got[s.name] = s.value
    return (got["tilepd_router_pool_alone_releases_total"], got["tilepd_router_pool_alone_hold_seconds_total"],
            got["tilepd_router_pool_alone_hold_seconds_squared_total"])


def test_only_leases_that_never_had_company_count_as_alone() -> None:
    clock = ManualClock()
    m, pool = router_metrics(nodes=2, clock=clock)

    async def main() -> None:
        a = await pool.acquire(1.0)
        clock.advance(0.5)
        a.release()  # alone throughout: 0.5 s
        b = await pool.acquire(1.0)
        clock.advance(0.25)
        c = await pool.acquire(1.0)  # b started alone and got company: neither counts
        clock.advance(1.0)
        b.release()
        clock.advance(1.0)
        c.release()  # alone for its last second, not throughout
        d = await pool.acquire(1.0)
        e = await pool.acquire(1.0)
        waiter = asyncio.create_task(pool.acquire(5.0))
        await asyncio.sleep(0)
        clock.advance(0.5)
        d.release()  # handed over to the waiter while e is held
        f = await waiter
        e.release()
        clock.advance(2.0)
        f.release()  # it began next to e: not alone
        g = await pool.acquire(1.0)
        clock.advance(1.5)
        g.release()  # alone: 1.5 s

    asyncio.run(main())
    n, total, squares = _alone(m)
    assert (n, total, squares) == pytest.approx((2, 2.0, 0.25 + 2.25))
