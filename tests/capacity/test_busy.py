"""Service time by busy nodes: the chain against Erlang C and the simulation, the model choice, the live path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.capacity.helpers import ManualClock, PoolDriver, local_topology, router_metrics, serving_metrics
from tilepd.capacity.busy import BusyLevels, busy_model
from tilepd.capacity.estimate import Load, Targets, estimate
from tilepd.capacity.queueing import erlang_c, predict, predict_by_busy
from tilepd.capacity.simulate import Exponential, GammaTimes, simulate
from tilepd.capacity.sources import AloneHolds, BusyLevel, Scrape, router_load
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
                                                         ((1.0, 1.2, 1.4, 1.6), 2.0, 1.0), ((0.1, 0.3), 5.0, 0.5)])
def test_simulation_matches_the_chain_for_exponential_work(means: tuple[float, ...], rate: float, timeout: float) -> None:
    # exponential work at a speed set by the busy count is exactly the birth-death chain: equal up to sampling noise
    c = len(means)
    f = predict_by_busy(rate, means, 1.0, c, timeout)
    s = simulate(rate, Exponential(1.0), c, timeout, requests=200_000, seed=5, by_busy=means)
    assert s.p_wait == pytest.approx(f.p_wait, rel=0.03)
    assert s.p99_wait_s == pytest.approx(f.p99_wait_s, rel=0.08)  # seeds 0-3: within 6%
    assert s.mean_wait_s == pytest.approx(f.mean_wait_s, rel=0.06)
    assert s.utilisation == pytest.approx(f.utilisation, rel=0.02)
    if math.isfinite(timeout):
        assert s.p_timeout == pytest.approx(f.p_timeout, abs=0.005)


def test_simulation_speed_follows_the_busy_count() -> None:
    same = simulate(1.5, Exponential(1.0), 2, requests=50_000, seed=1, by_busy=[1.0, 1.0])
    plain = simulate(1.5, Exponential(1.0), 2, requests=50_000, seed=1)
    assert same.p_wait == pytest.approx(plain.p_wait, rel=0.05) and same.utilisation == pytest.approx(plain.utilisation, rel=0.03)
    # fixed work, 1 s alone and 3 s with both busy: the carried node-time lies between, and grows with the load
    light = simulate(0.05, GammaTimes(1.0, 0.0), 2, requests=20_000, seed=1, by_busy=[1.0, 3.0])
    heavy = simulate(0.5, GammaTimes(1.0, 0.0), 2, requests=20_000, seed=1, by_busy=[1.0, 3.0])
    mean_light, mean_heavy = 2 * light.utilisation / 0.05, 2 * heavy.utilisation / 0.5  # node-seconds per request
    assert 1.0 < mean_light < 1.3 < mean_heavy < 3.0
    with pytest.raises(ValueError, match="every busy level"):
        simulate(1.0, Exponential(1.0), 2, requests=1000, by_busy=[1.0, 0.0])


def _lvl(mean: float, releases: float, busy: int) -> BusyLevel:
    seconds = mean * releases / busy  # each of the busy nodes completes at 1 / mean
    return BusyLevel(seconds, seconds * busy, releases)


def test_a_slowdown_gives_the_state_dependent_model_and_a_note() -> None:
    levels, notes = busy_model({"1": _lvl(0.113, 300, 1), "2": _lvl(0.215, 400, 2)})
    assert levels is not None and levels.means(3) == pytest.approx([0.113, 0.215, 0.215])
    assert "113 ms alone, 215 ms with 2 busy" in notes[0] and "share a host" in notes[0]
    assert "more than 2 busy" in notes[1]


def test_agreeing_or_thin_levels_keep_independent_nodes() -> None:
    levels, notes = busy_model({"1": _lvl(0.150, 300, 1), "2": _lvl(0.160, 400, 2)})
    assert levels is None and "within 15%" in notes[0]
    levels, notes = busy_model({"1": _lvl(0.113, 300, 1), "2": _lvl(0.215, 20, 2)})
    assert levels is None and "too few" in notes[0]
    assert busy_model(None)[0] is None and "older tilepd" in busy_model(None)[1][0]
    levels, notes = busy_model({"0": BusyLevel(10.0, 0.0, 0.0)})  # idle all along
    assert levels is None and "no lease ended" in notes[0]


def test_an_unmeasured_level_takes_the_nearest() -> None:
    levels, _ = busy_model({"1": _lvl(0.1, 100, 1), "2": _lvl(0.15, 5, 2), "3": _lvl(0.3, 100, 3), "8+": _lvl(0.6, 10, 8)})
    assert levels is not None and levels.top == 3 and levels.releases == (100, 0, 100)
    assert levels.means(2) == pytest.approx([0.1, 0.3])  # level 2 is thin: its neighbours tie, the slower one is taken


def test_work_cv_takes_out_the_speed_mix() -> None:
    levels = BusyLevels((0.1, 0.3), (100.0, 100.0))  # holds of 0.1 and 0.3 s in equal numbers: CV 0.5 from the mix alone
    assert levels.work_cv(0.5) == pytest.approx(0.0, abs=1e-6)
    assert levels.work_cv(0.8) == pytest.approx(math.sqrt((1 + 0.64) / 1.25 - 1))
    assert BusyLevels((0.2, 0.2), (10.0, 10.0)).work_cv(0.7) == pytest.approx(0.7)


def test_the_work_cv_comes_from_the_leases_that_ran_alone_when_there_are_enough() -> None:
    levels = {"1": _lvl(0.113, 300, 1), "2": _lvl(0.215, 400, 2)}
    holds = [0.08, 0.1, 0.12] * 20  # 60 leases alone: mean 0.1, CV sqrt(2/3) * 0.02 / 0.1
    alone = AloneHolds(len(holds), sum(holds), sum(h * h for h in holds))
    assert alone.mean_s == pytest.approx(0.1) and alone.cv == pytest.approx(math.sqrt(2 / 3) * 0.2)
    got, notes = busy_model(levels, alone)
    assert got is not None and got.alone_work_cv == pytest.approx(alone.cv)
    assert got.work_cv(0.9) == pytest.approx(alone.cv)  # the holds' own CV no longer matters
    assert any("CV 0.16, from the 60 leases that ran alone" in n for n in notes)
    few = AloneHolds(10, 1.0, 0.1)
    got, notes = busy_model(levels, few)
    assert got is not None and got.alone_work_cv is None and got.work_cv(0.5) < 0.5  # the holds' CV less their level mix
    assert any("fewer than 50 leases ran alone: the work's CV is taken from the holds" in n for n in notes)
    assert any("older tilepd: not recorded" in n for n in busy_model(levels, None)[1])
    assert math.isnan(AloneHolds(0, 0.0, 0.0).cv)


def test_estimate_uses_the_levels() -> None:
    levels = BusyLevels((0.113, 0.215), (300.0, 400.0))
    flat = Load(4.5, Exponential(0.16), 2.0, "test")
    dep = Load(4.5, Exponential(0.16), 2.0, "test", levels)
    t = Targets(60.0, 0.5)
    a, b = estimate(flat, t, 2, sim_requests=20_000), estimate(dep, t, 2, sim_requests=20_000)
    assert b.row(2).formula.p99_wait_s > a.row(2).formula.p99_wait_s
    assert b.row(2).simulation.p99_wait_s > a.row(2).simulation.p99_wait_s
    assert b.as_dict()["load"]["model"] == "state-dependent" and a.as_dict()["load"]["model"] == "independent"
    assert [x["busy"] for x in b.as_dict()["load"]["service_by_busy"]] == [1, 2]
    assert 0 < b.as_dict()["load"]["work_cv"] < 1.0


def test_router_load_reads_the_levels_of_real_leases() -> None:
    clock = ManualClock()
    m, pool = router_metrics(nodes=2, clock=clock)
    before = Scrape.parse(m.render().decode())
    load = router_load(before, before, 1.0)
    assert load.busy_levels == {}  # exported, nothing released yet
    driver = PoolDriver(m, pool, clock)
    driver.at_level(1, releases=4, hold_s=0.2)
    driver.at_level(2, releases=10, hold_s=0.4, wait_s=0.1)
    load = router_load(before, Scrape.parse(m.render().decode()), 1.0)
    assert load.busy_levels is not None and set(load.busy_levels) == {"1", "2"}
    assert load.busy_levels["1"].releases == 4 and load.busy_levels["2"].releases == 10
    assert load.busy_levels["1"].mean_service_s == pytest.approx(0.2)
    assert load.busy_levels["2"].mean_service_s == pytest.approx(0.4) and load.busy_levels["2"].seconds == pytest.approx(2.0)
    assert load.service.count == 14
    assert load.alone_holds is not None and load.alone_holds.releases == 4 and load.alone_holds.mean_s == pytest.approx(0.2)


def test_live_window_with_a_slowdown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tilepd.cli.capacity_cmds as cmds

    monkeypatch.setattr(cmds.time, "sleep", lambda s: None)  # a 60 s window, not waited for
    clock = ManualClock()
    metrics, pool = router_metrics(nodes=2, clock=clock)
    driver = PoolDriver(metrics, pool, clock)

    def load() -> None:
        driver.at_level(1, releases=120, hold_s=0.11)
        driver.at_level(2, releases=180, hold_s=0.22, wait_s=0.2)

    with serving_metrics(metrics, load) as port:
        app = build_app(["tilepd.cli.capacity_cmds"])
        topo = str(local_topology(tmp_path, port))
        r = CliRunner().invoke(app, ["capacity", topo, "--window", "60", "--sim-requests", "20000", "--nodes", "2", "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["load"]["model"] == "state-dependent"
        assert [round(x["mean_s"], 3) for x in out["load"]["service_by_busy"]] == [0.11, 0.22]
        assert any("alone" in n and "share a host" in n for n in out["notes"])
        assert out["measured"]["busy_levels"]["2"]["releases"] == 180
        assert out["measured"]["alone_holds"]["releases"] == 120 and out["measured"]["alone_holds"]["mean_s"] == pytest.approx(0.11)
        assert out["load"]["work_cv"] == pytest.approx(0.0, abs=1e-6) and out["load"]["work_cv_source"] == "alone"
