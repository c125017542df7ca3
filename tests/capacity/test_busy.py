"""Service time by busy nodes: the chain against Erlang C and the simulation, the model choice, the live path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.capacity.helpers import drive, lease_and_release, local_topology, router_metrics, serving_metrics
from tilepd.capacity.busy import BusyLevels, busy_model
from tilepd.capacity.estimate import Load, Targets, estimate
from tilepd.capacity.queueing import erlang_c, predict, predict_by_busy
from tilepd.capacity.simulate import Exponential, GammaTimes, simulate
from tilepd.capacity.sources import Histogram, Scrape, router_load
from tilepd.cli.app import build_app


@pytest.mark.parametrize(("rate", "mean", "cv", "c", "timeout"), [
    (1.0, 1.0, 1.0, 2, math.inf), (8.0, 1.0, 1.0, 10, math.inf), (4.5, 0.16, 0.6, 2, 2.0), (9.0, 1.0, 1.0, 10, 0.5),
    (3.0, 1.1, 0.5, 1, 5.0), (3.0, 1.1, 0.0, 4, 5.0),
])
def test_equal_levels_are_erlang_c(rate: float, mean: float, cv: float, c: int, timeout: float) -> None:
    chain = predict_by_busy(rate, [mean] * c, cv, c, timeout)
    mgc = predict(rate, mean, cv, c, timeout)
    for name in ("utilisation", "p_wait", "mean_wait_s", "p99_wait_s", "p_timeout"):
        assert getattr(chain, name) == pytest.approx(getattr(mgc, name), rel=1e-9, abs=1e-12), name
    if math.isinf(timeout):
        assert chain.p_wait == pytest.approx(erlang_c(c, rate * mean))


def test_slower_together_waits_longer_than_the_same_mean_independent() -> None:
    """113 ms alone, 215 ms with both busy: the queue drains at 2 / 0.215 s, not 2 / E[S]."""
    chain = predict_by_busy(4.5, [0.113, 0.215], 1.0, 2, 2.0)
    flat = predict(4.5, 0.16, 1.0, 2, 2.0)
    assert chain.p99_wait_s > 1.5 * flat.p99_wait_s


@pytest.mark.parametrize(("means", "rate", "timeout"), [((1.0, 1.5), 1.0, math.inf), ((0.113, 0.215), 6.0, 2.0),
                                                         ((1.0, 1.2, 1.4, 1.6), 2.0, 1.0)])
def test_simulation_matches_the_chain_for_exponential_service(means: tuple[float, ...], rate: float, timeout: float) -> None:
    # the simulation keeps a service time drawn at the start while the chain changes rate with the busy count: close, not equal
    c = len(means)
    f = predict_by_busy(rate, means, 1.0, c, timeout)
    s = simulate(rate, Exponential(1.0), c, timeout, requests=120_000, seed=5, by_busy=[Exponential(m) for m in means])
    assert s.p_wait == pytest.approx(f.p_wait, rel=0.05)
    assert s.p99_wait_s == pytest.approx(f.p99_wait_s, rel=0.1)
    assert s.mean_wait_s == pytest.approx(f.mean_wait_s, rel=0.12)
    assert s.utilisation == pytest.approx(f.utilisation, rel=0.04)
    if math.isfinite(timeout):
        assert s.p_timeout == pytest.approx(f.p_timeout, abs=0.015)


def test_simulation_draws_at_the_busy_count_of_each_start() -> None:
    same = simulate(1.5, Exponential(1.0), 2, requests=50_000, seed=1, by_busy=[Exponential(1.0), Exponential(1.0)])
    plain = simulate(1.5, Exponential(1.0), 2, requests=50_000, seed=1)
    assert same.p_wait == pytest.approx(plain.p_wait, rel=0.05) and same.utilisation == pytest.approx(plain.utilisation, rel=0.03)
    # fixed times, 1 s alone and 3 s with both busy: the carried work tells which level each start drew from
    slow = simulate(0.3, Exponential(1.0), 2, requests=50_000, seed=1, by_busy=[GammaTimes(1.0, 0.0), GammaTimes(3.0, 0.0)])
    share_two = (2 * slow.utilisation / 0.3 - 1.0) / 2.0  # mean service = 1 + 2 x share of starts at 2 busy
    assert 0.1 < share_two < 0.7


def _hist(mean: float, count: float) -> Histogram:
    edges = (0.05, 0.1, 0.2, 0.4, 0.8)
    i = next(k for k, e in enumerate(edges) if e >= mean)
    cum = tuple(0.0 if k < i else count for k in range(len(edges) + 1))
    return Histogram(edges, cum, mean * count, count)


def test_a_slowdown_gives_the_state_dependent_model_and_a_note() -> None:
    levels, notes = busy_model({"1": _hist(0.113, 300), "2": _hist(0.215, 400)})
    assert levels is not None and levels.means(3) == pytest.approx([0.113, 0.215, 0.215])
    assert "113 ms alone, 215 ms with 2 busy" in notes[0] and "share a host" in notes[0]
    assert "more than 2 busy" in notes[1]


def test_agreeing_or_thin_levels_keep_independent_nodes() -> None:
    levels, notes = busy_model({"1": _hist(0.150, 300), "2": _hist(0.160, 400)})
    assert levels is None and "within 15%" in notes[0]
    levels, notes = busy_model({"1": _hist(0.113, 300), "2": _hist(0.215, 20)})
    assert levels is None and "too few" in notes[0]
    assert busy_model(None)[0] is None and "older tilepd" in busy_model(None)[1][0]


def test_an_unmeasured_level_takes_the_nearest() -> None:
    levels, _ = busy_model({"1": _hist(0.1, 100), "2": _hist(0.15, 5), "3": _hist(0.3, 100), "8+": _hist(0.6, 10)})
    assert levels is not None and levels.top == 3 and levels.counts == (100, 0, 100)
    assert levels.means(2) == pytest.approx([0.1, 0.3])  # level 2 is thin: its neighbours tie, the slower one is taken


def test_estimate_uses_the_levels() -> None:
    levels = BusyLevels((Exponential(0.113), Exponential(0.215)), (300.0, 400.0))
    flat = Load(4.5, Exponential(0.16), 2.0, "test")
    dep = Load(4.5, Exponential(0.16), 2.0, "test", levels)
    t = Targets(60.0, 0.5)
    a, b = estimate(flat, t, 2, sim_requests=20_000), estimate(dep, t, 2, sim_requests=20_000)
    assert b.row(2).formula.p99_wait_s > a.row(2).formula.p99_wait_s
    assert b.as_dict()["load"]["model"] == "state-dependent" and a.as_dict()["load"]["model"] == "independent"
    assert [x["busy"] for x in b.as_dict()["load"]["service_by_busy"]] == [1, 2]


def test_router_load_reads_the_levels_of_real_leases() -> None:
    m, pool = router_metrics(nodes=2)
    before = Scrape.parse(m.render().decode())
    load = router_load(before, before, 1.0)
    assert load.service_by_busy == {}  # exported, nothing yet
    lease_and_release(m, pool, 4)  # one at a time: all alone
    drive(m, served=10, hold_s=0.4, wait_s=0.1, busy=2)
    load = router_load(before, Scrape.parse(m.render().decode()), 1.0)
    assert load.service_by_busy is not None and set(load.service_by_busy) == {"1", "2"}
    assert load.service_by_busy["1"].count == 4 and load.service_by_busy["2"].count == 10
    assert load.service_by_busy["2"].mean == pytest.approx(0.4)
    assert load.service.count == 14


def test_live_window_with_a_slowdown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tilepd.cli.capacity_cmds as cmds

    monkeypatch.setattr(cmds.time, "sleep", lambda s: None)  # a 60 s window, not waited for
    metrics, _ = router_metrics(nodes=2)

    def load() -> None:
        drive(metrics, served=120, hold_s=0.11, wait_s=0.0001, busy=1)
        drive(metrics, served=180, hold_s=0.22, wait_s=0.2, busy=2)

    with serving_metrics(metrics, load) as port:
        app = build_app(["tilepd.cli.capacity_cmds"])
        topo = str(local_topology(tmp_path, port))
        r = CliRunner().invoke(app, ["capacity", topo, "--window", "60", "--sim-requests", "20000", "--nodes", "2", "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["load"]["model"] == "state-dependent"
        assert [round(x["mean_s"], 3) for x in out["load"]["service_by_busy"]] == [0.11, 0.22]
        assert any("alone" in n and "share a host" in n for n in out["notes"])
        assert out["measured"]["service_by_busy"]["2"]["count"] == 180
