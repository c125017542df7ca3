"""Erlang C against textbook values; the closed forms against the simulation."""

from __future__ import annotations

import math

import pytest

from tilepd.capacity.queueing import erlang_b, erlang_c, nodes_needed, predict
from tilepd.capacity.simulate import Empirical, Exponential, GammaTimes, simulate


@pytest.mark.parametrize(("c", "a", "want"), [
    (2, 1.0, 1 / 3),  # c=2, a=1: P(wait) = 1/3
    (1, 0.5, 0.5),  # M/M/1: P(wait) = rho
    (10, 8.0, 0.4092),  # the call-centre textbook case: 10 agents, 8 erlangs
    (5, 4.0, 0.5541),
])
def test_erlang_c_textbook(c: int, a: float, want: float) -> None:
    assert erlang_c(c, a) == pytest.approx(want, abs=5e-5)


def test_erlang_b_and_overload() -> None:
    assert erlang_b(1, 1.0) == pytest.approx(0.5)
    assert erlang_b(2, 1.0) == pytest.approx(0.2)
    assert erlang_c(3, 3.0) == 1.0
    p = predict(4.0, 1.0, 1.0, 3)  # no timeout, more offered than served: the queue grows without bound
    assert not p.stable and math.isinf(p.p99_wait_s)


def test_no_timeout_is_erlang_c() -> None:
    p = predict(rate=1.0, mean_service_s=1.0, service_cv=1.0, nodes=2)
    assert p.p_wait == pytest.approx(1 / 3)
    assert p.mean_wait_s == pytest.approx(1 / 3)  # C / (c mu - lambda)
    assert p.p99_wait_s == pytest.approx(math.log((1 / 3) / 0.01))
    # a timeout far beyond any wait changes nothing
    far = predict(1.0, 1.0, 1.0, 2, timeout_s=1e6)
    assert (far.p_wait, far.p99_wait_s, far.p_timeout) == pytest.approx((p.p_wait, p.p99_wait_s, 0.0))


def test_md1_mean_wait_is_pollaczek_khinchine() -> None:
    # fixed service, one server: the Allen-Cunneen factor 1/2 is exact for the mean wait
    rho = 0.7
    assert predict(rho, 1.0, 0.0, 1).mean_wait_s == pytest.approx(rho / (2 * (1 - rho)))


@pytest.mark.parametrize(("c", "rate", "timeout"), [(2, 1.2, math.inf), (4, 2.4, math.inf), (4, 3.6, 1.0), (8, 9.0, 0.5)])
def test_simulation_matches_the_formula_for_exponential_service(c: int, rate: float, timeout: float) -> None:
    f = predict(rate, 1.0, 1.0, c, timeout)
    s = simulate(rate, Exponential(1.0), c, timeout, requests=200_000, seed=7)
    assert s.p_wait == pytest.approx(f.p_wait, rel=0.03)
    assert s.mean_wait_s == pytest.approx(f.mean_wait_s, rel=0.06)
    assert s.p99_wait_s == pytest.approx(f.p99_wait_s, rel=0.06)
    assert s.utilisation == pytest.approx(f.utilisation, rel=0.03)
    if math.isfinite(timeout):  # M/M/c+D is exact: the 429/fallback share too
        assert s.p_timeout == pytest.approx(f.p_timeout, rel=0.06)


def test_md1_simulation_matches_pollaczek_khinchine() -> None:
    s = simulate(0.7, GammaTimes(1.0, 0.0), 1, requests=200_000, seed=3)
    assert s.mean_wait_s == pytest.approx(0.7 / (2 * 0.3), rel=0.05)


def test_simulation_is_seeded_and_bounded() -> None:
    a = simulate(3.0, Exponential(1.0), 4, 2.0, requests=5000, seed=11)
    assert a == simulate(3.0, Exponential(1.0), 4, 2.0, requests=5000, seed=11)
    assert a != simulate(3.0, Exponential(1.0), 4, 2.0, requests=5000, seed=12)
    with pytest.raises(ValueError, match="requests"):
        simulate(3.0, Exponential(1.0), 4, requests=10**8)


def test_empirical_distribution_keeps_the_measured_mean() -> None:
    import numpy as np

    d = Empirical(edges=(1.0, 2.0, 4.0), counts=(0.0, 10.0, 10.0, 0.0), exact_mean=2.4)
    x = d.sample(np.random.default_rng(0), 100_000)
    assert x.mean() == pytest.approx(2.4, rel=0.01)
    assert 0 < d.cv < 1
    assert x.min() >= 1.0 * 2.4 / 2.5 - 1e-9  # bucket (1, 2] rescaled by exact/piecewise mean (2.4 / 2.5)


def test_nodes_needed_is_the_fewest_that_meet_both_targets() -> None:
    c = nodes_needed(rate=5.0, mean_service_s=1.0, service_cv=1.0, timeout_s=2.0, target_p99_wait_s=0.2, target_timeout=0.01)
    ok = predict(5.0, 1.0, 1.0, c, 2.0)
    short = predict(5.0, 1.0, 1.0, c - 1, 2.0)
    assert ok.p99_wait_s <= 0.2 and ok.p_timeout <= 0.01
    assert short.p99_wait_s > 0.2 or short.p_timeout > 0.01
