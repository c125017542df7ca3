"""Parsing the router's own /metrics rendering (tilepd.router.metrics), and the load over a window."""

from __future__ import annotations

import pytest

from tests.capacity.helpers import drive, lease_and_release, router_metrics
from tilepd.capacity.sources import MetricsInvalid, Scrape, combined, router_load, seconds_per_token


def test_router_load_over_a_window() -> None:
    m, _ = router_metrics(nodes=3)
    drive(m, served=5, hold_s=0.2, wait_s=0.0001)  # before the window
    before = Scrape.parse(m.render().decode())
    drive(m, served=40, hold_s=1.5, wait_s=0.3, refused=6, fallbacks=4)
    load = router_load(before, Scrape.parse(m.render().decode()), window_s=10.0)
    assert load.arrivals == 50 and load.leased == 40
    assert (load.busy_429, load.busy_fallback) == (6, 4)
    assert load.rate == pytest.approx(5.0)
    assert load.busy_fraction == pytest.approx(0.2)
    assert load.routes == {"low_latency/default": 40, "low_latency/busy": 6, "native/busy": 4}
    assert load.service.count == 40 and load.service.mean == pytest.approx(1.5)
    assert load.service_source == "tilepd_router_lease_hold_seconds"
    assert load.measured_utilisation(3) == pytest.approx(40 * 1.5 / 30)
    assert load.nodes_in_rotation == 3
    # every served wait was 0.3 s: the p99 is inside the bucket holding 0.3, the fine buckets keep it within ~20%
    assert 0.24 < load.wait.quantile(0.99) <= 0.36
    assert load.wait.fraction_above(0.0005) == pytest.approx(1.0)
    dist = load.service.distribution()
    assert dist.mean == pytest.approx(1.5)
    assert dist.cv < 0.1  # one narrow bucket


def test_two_routers_windows_are_summed_and_taken_as_independent_nodes() -> None:
    windows = []
    for served, refused in ((30, 2), (10, 4)):
        m, _ = router_metrics(nodes=2)
        before = Scrape.parse(m.render().decode())
        drive(m, served=served, hold_s=1.0, wait_s=0.1, refused=refused)
        windows.append(router_load(before, Scrape.parse(m.render().decode()), window_s=10.0))
    both = combined(windows)
    assert (both.arrivals, both.leased, both.busy_429) == (46, 40, 6)
    assert both.routes == {"low_latency/default": 40, "low_latency/busy": 6}
    assert both.service.count == 40 and both.service.mean == pytest.approx(1.0) and both.wait.count == 40
    assert both.rate == pytest.approx(4.6) and both.nodes_in_rotation == 2
    assert both.busy_levels is None and both.alone_holds is None  # per-router chains do not add up
    assert any("2 routers" in n for n in both.notes)


def test_the_release_hook_records_real_leases() -> None:
    m, pool = router_metrics(nodes=2)
    before = Scrape.parse(m.render().decode())
    lease_and_release(m, pool, 7)
    load = router_load(before, Scrape.parse(m.render().decode()), window_s=1.0)
    assert load.service.count == 7 and load.leased == 7
    assert 0 <= load.service.mean < 0.5


def test_an_older_router_without_the_hold_histogram_is_named() -> None:
    m, _ = router_metrics()
    text = m.render().decode()
    old = "\n".join(line for line in text.splitlines() if "lease_hold" not in line) + "\n"
    drive(m, served=3, hold_s=1.0, wait_s=0.0)
    m.request_seconds.labels("low_latency").observe(1.2)
    after = "\n".join(line for line in m.render().decode().splitlines() if "lease_hold" not in line) + "\n"
    load = router_load(Scrape.parse(old), Scrape.parse(after), 1.0)
    assert load.service_source.startswith("tilepd_router_request_seconds")
    assert any("overstates" in n for n in load.notes)
    with pytest.raises(MetricsInvalid, match="tilepd_router_lease_wait_seconds"):
        router_load(Scrape.parse("# nothing\n"), Scrape.parse("# nothing\n"), 1.0)


def test_decode_per_token_time() -> None:
    from tilepd.runtime.metrics import DecodeMetrics

    class _Slot:
        transfers_total = bytes_total = reservations_expired = 0
        busy = False

    d = DecodeMetrics(_Slot(), lambda: 0)  # type: ignore[arg-type]
    assert seconds_per_token([Scrape.parse(_render(d.registry))]) is None
    d.decode.observe(0.5)
    d.tokens.inc(100)
    assert seconds_per_token([Scrape.parse(_render(d.registry))]) == pytest.approx(0.005)


def _render(registry) -> str:  # noqa: ANN001
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()
