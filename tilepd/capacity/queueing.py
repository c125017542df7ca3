"""Closed-form M/G/c waits with the router's queue timeout: Erlang C, Allen-Cunneen corrected.

Arrivals are Poisson (CV 1: many independent clients). Service is exponential in the exact
model, which is M/M/c+D: c servers, FIFO, and a request leaves after a fixed patience T
(the router's `queue_timeout_s`: 429, or the native pool). Its virtual wait has the density
(Baccelli & Hebuterne, 1981) q e^(-theta x) on (0, T) and q e^(-theta T) e^(-c mu (x-T)) beyond,
with theta = c mu - lambda and q = lambda P(c-1 busy), next to the Poisson terms of the idle
states; with T infinite this is Erlang C. For another service-time CV the wait scales by the
Allen-Cunneen factor k = (Ca^2 + Cs^2) / 2 (Kingman's for one server): the exponent becomes
theta x / k, the masses stay. Waits are reported over the requests served, as the router's
`tilepd_router_lease_wait_seconds` measures them; the share that waits past T is the
429 / fallback rate. simulate.py checks these figures with the measured distribution.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from collections.abc import Sequence
from typing import Any


def erlang_b(c: int, a: float) -> float:
    """Blocking probability of M/M/c/c with offered load a = lambda / mu (stable recurrence)."""
    if c < 0 or a < 0:
        raise ValueError(f"erlang_b needs c >= 0 and a >= 0, got c={c}, a={a}")
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    return b


def erlang_c(c: int, a: float) -> float:
    """P(an arrival waits) in M/M/c with offered load a (1.0 when a >= c: the queue grows without bound)."""
    if c < 1:
        raise ValueError(f"erlang_c needs at least one server, got c={c}")
    if a >= c:
        return 1.0
    b = erlang_b(c, a)
    return c * b / (c - a * (1.0 - b))


@dataclass(frozen=True)
class Prediction:
    """What c nodes give at one load (times in seconds, rates as fractions of arrivals)."""

    nodes: int
    utilisation: float  # carried load per node: a (1 - p_timeout) / c
    p_wait: float  # P(a request waits at all)
    mean_wait_s: float  # over the requests served
    p99_wait_s: float  # over the requests served (inf when overloaded)
    p_timeout: float  # fraction that waits past the queue timeout: 429 or native fallback
    stable: bool

    def as_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


def allen_cunneen_factor(service_cv: float, arrival_cv: float = 1.0) -> float:
    """(Ca^2 + Cs^2) / 2: 1 for exponential service, 1/2 for fixed service times."""
    if service_cv < 0 or arrival_cv < 0:
        raise ValueError("coefficients of variation must be >= 0")
    return (arrival_cv**2 + service_cv**2) / 2.0


def predict(rate: float, mean_service_s: float, service_cv: float, nodes: int, timeout_s: float = math.inf,
            quantile: float = 0.99) -> Prediction:
    """M/G/c+D at `rate` requests/s, service time of mean `mean_service_s` and CV `service_cv`, on `nodes` nodes."""
    _check(rate, mean_service_s, nodes, quantile)
    a = rate * mean_service_s
    # everything relative to P(c-1 busy): the idle states sum to 1 / ErlangB(c-1, a), their busy nodes to a (1 - B) / B
    b = erlang_b(nodes - 1, a)
    return _with_patience(rate, b, a * (1.0 - b), nodes / mean_service_s, service_cv, nodes, timeout_s, quantile)


def predict_by_busy(rate: float, level_means_s: Sequence[float], service_cv: float, nodes: int, timeout_s: float = math.inf,
                    quantile: float = 0.99) -> Prediction:
    """The state-dependent pool: with k nodes busy each completes at 1 / `level_means_s[k-1]`.

    A birth-death chain on the busy nodes (completion rate in state k < c: k / E[S | k]) below the full
    pool; with all c busy the pool hands nodes over at c / E[S | c] whatever the queue, so the waiting
    part is the M/M/c+D one (Baccelli & Hebuterne) at that rate: exact for exponential work, the
    Allen-Cunneen factor of the work's CV (`service_cv`) otherwise. Equal means give `predict`. The
    router measures exactly these rates (releases per node-second at each busy level).
    """
    if len(level_means_s) < nodes:
        raise ValueError(f"predict_by_busy needs a mean service time for each of 1..{nodes} busy nodes, got {len(level_means_s)}")
    _check(rate, min(level_means_s[:nodes]), nodes, quantile)
    # the loss chain on 0..c-1 busy: B_m = a_m B_(m-1) / (m + a_m B_(m-1)) with a_m = rate E[S | m] (Erlang B's recurrence)
    b, busy = 1.0, 0.0  # P(c-1 busy) of the chain truncated at c-1, and its mean busy nodes
    for m in range(1, nodes):
        a_m = rate * level_means_s[m - 1]
        b_new = a_m * b / (m + a_m * b)
        busy = busy * (1.0 - b_new) + m * b_new  # the new state m takes B_m of the mass
        b = b_new
    return _with_patience(rate, b, busy, nodes / level_means_s[nodes - 1], service_cv, nodes, timeout_s, quantile)


def _check(rate: float, mean_service_s: float, nodes: int, quantile: float) -> None:
    if rate <= 0 or mean_service_s <= 0:
        raise ValueError(f"rate and mean service time must be > 0, got rate={rate}, mean_service_s={mean_service_s}")
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")


def _with_patience(rate: float, b: float, idle_busy: float, full_rate: float, service_cv: float, nodes: int, timeout_s: float,
                   quantile: float) -> Prediction:
    """The M/M/c+D masses: `b` = P(c-1 busy) and `idle_busy` = mean busy nodes of the chain below the full pool
    (truncated at c-1), `full_rate` = the pool's hand-over rate with all c busy; waits scaled by Allen-Cunneen."""
    k = allen_cunneen_factor(service_cv)
    theta = full_rate - rate
    if b <= 0.0:  # the full pool is never reached (underflow): nobody waits
        return Prediction(nodes, idle_busy / nodes, 0.0, 0.0, 0.0, 0.0, True)
    idle = 1.0 / b  # relative to P(c-1 busy)
    busy_idle = idle_busy * idle  # sum of n P(n busy), n < c, relative to P(c-1 busy)
    if not math.isfinite(timeout_s):
        if theta <= 0:
            return Prediction(nodes, 1.0, 1.0, math.inf, math.inf, 1.0, False)
        queued = rate / theta
        z = idle + queued
        c_wait = queued / z
        decay = theta / k
        p99 = math.log(c_wait / (1 - quantile)) / decay if c_wait > 1 - quantile else 0.0
        return Prediction(nodes, (busy_idle + nodes * queued) / z / nodes, c_wait, c_wait / decay, p99, 0.0, True)
    x = theta * timeout_s / k
    if abs(x) < 1e-9:  # theta ~ 0: the limits of the expressions below
        within, edge = rate * timeout_s / k, 1.0
        area = rate * timeout_s**2 / (2 * k)
    else:
        edge = math.exp(-x)
        within = rate * (1.0 - edge) / theta  # waits in (0, T)
        area = rate / theta * (k / theta * (1.0 - edge) - timeout_s * edge)  # integral of P(W > t, served) on (0, T)
    beyond = rate * edge / full_rate  # would wait past T: they leave
    z = idle + within + beyond
    p_timeout = beyond / z
    served = 1.0 - p_timeout
    p_wait = (within + beyond) / z
    target = (1 - quantile) * served * z  # unnormalised P(W > t, served) at the quantile
    if within <= target:
        p99 = 0.0
    elif abs(x) < 1e-9:
        p99 = timeout_s - target * k / rate
    else:
        p99 = -k / theta * math.log(target * theta / rate + edge)
    utilisation = (busy_idle + nodes * (within + beyond)) / z / nodes
    return Prediction(nodes, utilisation, p_wait, area / z / served, min(max(p99, 0.0), timeout_s), p_timeout, True)


def meets(p: Prediction, target_p99_wait_s: float, target_timeout: float) -> bool:
    return p.stable and p.p99_wait_s <= target_p99_wait_s and p.p_timeout <= target_timeout


def nodes_needed(rate: float, mean_service_s: float, service_cv: float, timeout_s: float, target_p99_wait_s: float,
                 target_timeout: float, max_nodes: int = 4096) -> int:
    """The fewest nodes whose predicted p99 wait and timeout fraction meet both targets."""
    c = 1
    while c <= max_nodes:
        if meets(predict(rate, mean_service_s, service_cv, c, timeout_s), target_p99_wait_s, target_timeout):
            return c
        c += 1
    raise ValueError(f"more than {max_nodes} nodes would be needed for {rate:g} req/s at {mean_service_s:g} s each")
