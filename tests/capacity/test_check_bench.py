"""The pure parts of bench/capacity_check.py (no stack): quantile, the pass rule, the FIFO replay."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("capacity_check", REPO / "bench" / "capacity_check.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("capacity_check", bench)  # dataclasses look their module up there
_spec.loader.exec_module(bench)


def test_percentile_is_numpys_linear_quantile() -> None:
    rng = np.random.default_rng(1)
    values = rng.exponential(0.2, 537).tolist()
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert bench.percentile(values, q) == pytest.approx(float(np.quantile(values, q)))
    assert math.isnan(bench.percentile([], 0.99))


def test_compare_bound_and_meaningless_cases() -> None:
    assert bench.compare(1.25, 1.0, 0.25) == (1.25, True)
    assert bench.compare(0.74, 1.0, 0.25)[1] is False
    assert bench.compare(None, 1.0, 0.25)[1] is False
    assert bench.compare(0.3, 0.0, 0.25)[1] is False  # no queueing: a ratio means nothing


def test_saturated_level_does_not_pass() -> None:
    lv = {"window": {"p99_wait_s": 1.99},
          "capacity": {"current": {"formula": {"p99_wait_s": 1.98}, "simulation": {"p99_wait_s": 1.99}}, "measured": {}}}
    v = bench.verdict(lv, 0.25, 2.0)
    assert v["saturated"] and not v["pass"]
    lv["window"]["p99_wait_s"] = 0.5
    lv["capacity"]["current"] = {"formula": {"p99_wait_s": 0.55}, "simulation": {"p99_wait_s": 0.45}}
    assert bench.verdict(lv, 0.25, 2.0)["pass"]


def test_replay_is_fifo_with_patience() -> None:
    S = bench.Sent
    sent = [S(0.0, 200, 0.0, 0.0, 1.0), S(0.1, 200, 0.0, 0.0, 1.0), S(0.2, 200, 0.0, 0.0, 1.0), S(0.3, 200, 0.0, 0.0, 0.5),
            S(0.4, 429, None, 0.0, None)]
    waits = [w for _, w in bench.replay(sent, 2, 2.0)]
    assert waits == pytest.approx([0.0, 0.0, 0.8, 0.8])  # two nodes, the third and fourth wait for them
    assert [w for _, w in bench.replay(sent, 1, 0.5)] == pytest.approx([0.0])  # one node, 0.5 s patience: the rest leave


def test_shuffled_replay_matches_the_model_for_iid_service() -> None:
    """Poisson arrivals and i.i.d. exponential service: the shuffled replay is an M/M/2 run, near the closed form."""
    from tilepd.capacity.queueing import predict

    rng = np.random.default_rng(3)
    rate, mean = 6.0, 0.2
    t = np.cumsum(rng.exponential(1 / rate, 20000))
    sent = [bench.Sent(float(a), 200, 0.0, 0.0, float(s)) for a, s in zip(t, rng.exponential(mean, len(t)))]
    p99 = bench.shuffled_replay_p99(sent, sent[2000:], 2, math.inf, rounds=2)
    assert p99 == pytest.approx(predict(rate, mean, 1.0, 2).p99_wait_s, rel=0.1)


def test_service_by_company() -> None:
    S = bench.Sent
    sent = [S(0.0, 200, 0.0, 0.0, 0.1), S(1.0, 200, 0.0, 0.0, 0.4), S(1.1, 200, 0.0, 0.0, 0.4), S(3.0, 200, 0.0, 0.0, 0.1)]
    out = bench.service_by_company(sent)
    assert out["alone_n"] == 2 and out["alone_mean_s"] == pytest.approx(0.1)
    assert out["shared_n"] == 2 and out["shared_mean_s"] == pytest.approx(0.4)


def test_one_windows_p99_strays_less_in_a_longer_window() -> None:
    """The band is the spread of one window's p99 around the long run's under the chosen model: it holds 1, and a
    window five times longer narrows it (the state-dependent and the independent model alike)."""
    chain = {"rate_per_s": 6.0, "queue_timeout_s": 2.0, "work_cv": 0.2, "service_mean_s": 0.156, "service_cv": 0.5,
             "service_by_busy": [{"busy": 1, "mean_s": 0.112}, {"busy": 2, "mean_s": 0.186}]}
    for load in (chain, {**chain, "service_by_busy": None}):
        short, long = bench.window_band(load, 150.0, 0.25, windows=60), bench.window_band(load, 750.0, 0.25, windows=60)
        assert short is not None and long is not None
        assert short["p10"] < 1.0 < short["p90"] and long["p10"] < 1.05 and long["p90"] > 0.95
        assert long["p90"] - long["p10"] < short["p90"] - short["p10"]
        assert 0.0 <= short["within_bound"] <= long["within_bound"] <= 1.0
    assert bench.window_band({"rate_per_s": 0.0, "queue_timeout_s": 2.0}, 150.0, 0.25) is None


def test_cpu_times_reads_proc_stat() -> None:
    text = "cpu  1412055 3933 1154737 819300 4717 0 4695 4812 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    got = bench.cpu_times(text)
    assert got["user"] == pytest.approx(14120.55) and got["steal"] == pytest.approx(48.12) and got["idle"] == pytest.approx(8193.0)
    with pytest.raises(ValueError, match="not a /proc/stat"):
        bench.cpu_times("intr 1 2 3\n")
    if Path("/proc/stat").exists():
        assert bench.cpu_times(Path("/proc/stat").read_text())["idle"] > 0
