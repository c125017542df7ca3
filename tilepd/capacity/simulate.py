"""Discrete-event check of the closed forms: FIFO, c batch=1 nodes, Poisson arrivals, the router's queue timeout.

The router hands a freed node to the oldest waiter and a waiter leaves after exactly
`queue_timeout_s` (429 or the native pool). With FIFO and a fixed patience the
simulation needs no event list: requests are taken in arrival order, each starts on the
node that frees first, and one that would start after its timeout leaves without taking
a node. Seeded and bounded (`requests`), so a run is reproducible and takes well under a
second per 100k requests.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np


class ServiceTimes(Protocol):
    """A service-time distribution the simulation draws from."""

    @property
    def mean(self) -> float: ...

    @property
    def cv(self) -> float: ...

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Exponential:
    mean: float

    @property
    def cv(self) -> float:
        return 1.0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.exponential(self.mean, n)

    def describe(self) -> str:
        return f"exponential, mean {self.mean:.4g} s"


@dataclass(frozen=True)
class GammaTimes:
    """Gamma with a given mean and CV; CV 0 is a fixed time (every request the same lengths)."""

    mean: float
    cv: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.cv == 0:
            return np.full(n, self.mean)
        shape = 1.0 / self.cv**2
        return rng.gamma(shape, self.mean / shape, n)

    def describe(self) -> str:
        return f"fixed {self.mean:.4g} s" if self.cv == 0 else f"gamma, mean {self.mean:.4g} s, CV {self.cv:.3g}"


@dataclass(frozen=True)
class Empirical:
    """A measured histogram: counts between bucket edges, uniform inside a bucket, rescaled to the exact mean.

    `edges` are the finite upper bounds (the first bucket starts at 0); `counts` has one
    more entry, the +Inf bucket, drawn at the last finite edge (stated in `describe`).
    """

    edges: tuple[float, ...]
    counts: tuple[float, ...]
    exact_mean: float

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.edges) + 1 or sum(self.counts) <= 0:
            raise ValueError("an empirical distribution needs len(edges)+1 non-negative counts with a positive total")

    def _bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo = np.array((0.0, *self.edges))
        hi = np.array((*self.edges, self.edges[-1]))
        p = np.asarray(self.counts, dtype=float)
        return lo, hi, p / p.sum()

    def _raw_moments(self) -> tuple[float, float]:
        lo, hi, p = self._bounds()
        m1 = float(np.sum(p * (lo + hi) / 2))
        m2 = float(np.sum(p * (lo**2 + lo * hi + hi**2) / 3))
        return m1, m2

    @property
    def mean(self) -> float:
        return self.exact_mean

    @property
    def cv(self) -> float:
        m1, m2 = self._raw_moments()
        return math.sqrt(max(m2 - m1 * m1, 0.0)) / m1 if m1 > 0 else 0.0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        lo, hi, p = self._bounds()
        idx = rng.choice(len(p), size=n, p=p)
        draws = lo[idx] + (hi[idx] - lo[idx]) * rng.random(n)
        m1, _ = self._raw_moments()
        return draws * (self.exact_mean / m1) if m1 > 0 else draws

    def describe(self) -> str:
        tail = f", {self.counts[-1]:g} above {self.edges[-1]:g} s drawn at {self.edges[-1]:g} s" if self.counts[-1] else ""
        return f"measured histogram of {sum(self.counts):g} requests, mean {self.exact_mean:.4g} s, CV {self.cv:.3g}{tail}"


@dataclass(frozen=True)
class SimResult:
    nodes: int
    requests: int  # after the warm-up
    utilisation: float  # node busy time / (nodes x span)
    p_wait: float  # waited at all (those timed out included)
    mean_wait_s: float  # of the served
    p99_wait_s: float  # of the served, as the router measures it
    p_timeout: float  # waited past the queue timeout: 429 or native fallback

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


MAX_REQUESTS = 2_000_000


def simulate(rate: float, service: ServiceTimes, nodes: int, timeout_s: float = math.inf, *, requests: int = 100_000,
             seed: int = 0, warmup: float = 0.1, quantile: float = 0.99,
             by_busy: Sequence[ServiceTimes] | None = None) -> SimResult:
    """Run `requests` Poisson arrivals at `rate`/s through `nodes` FIFO batch=1 nodes; the first `warmup` share is not counted.

    With `by_busy`, a request that starts while k nodes are busy (itself included) draws its service time from
    `by_busy[min(k, len) - 1]` instead of `service`: nodes sharing a host slow each other down, as the router's
    `tilepd_router_lease_hold_by_busy_seconds` records it.
    """
    if rate <= 0 or nodes < 1:
        raise ValueError(f"simulate needs rate > 0 and nodes >= 1, got rate={rate}, nodes={nodes}")
    if not 1000 <= requests <= MAX_REQUESTS:
        raise ValueError(f"requests must be in [1000, {MAX_REQUESTS}], got {requests}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, requests)).tolist()
    if by_busy:
        return _simulate_by_busy(rng, arrivals, by_busy, nodes, timeout_s, warmup, quantile)
    services = service.sample(rng, requests).tolist()
    skip = int(requests * warmup)
    free = [0.0] * nodes  # heap of the times each node frees
    waits: list[float] = []
    waited = timed_out = 0
    busy = 0.0
    for i, (t, s) in enumerate(zip(arrivals, services)):
        start = t if free[0] <= t else free[0]
        wait = start - t
        if wait > timeout_s:
            if i >= skip:
                timed_out += 1
                waited += 1
            continue
        heapq.heapreplace(free, start + s)
        if i >= skip:
            waits.append(wait)
            waited += wait > 0
            busy += s
    return _result(arrivals, skip, nodes, waits, waited, timed_out, busy, quantile)


def _simulate_by_busy(rng: np.random.Generator, arrivals: list[float], by_busy: Sequence[ServiceTimes], nodes: int,
                      timeout_s: float, warmup: float, quantile: float) -> SimResult:
    """The FIFO run with each service time drawn at its start from the busy count then (a sorted list of free times)."""
    requests = len(arrivals)
    draws = [d.sample(rng, requests).tolist() for d in by_busy]
    used = [0] * len(by_busy)
    top = len(by_busy)
    skip = int(requests * warmup)
    free = [0.0] * nodes  # sorted: the times each node frees
    waits: list[float] = []
    waited = timed_out = 0
    busy = 0.0
    for i, t in enumerate(arrivals):
        start = t if free[0] <= t else free[0]
        wait = start - t
        if wait > timeout_s:
            if i >= skip:
                timed_out += 1
                waited += 1
            continue
        level = min(1 + nodes - bisect.bisect_right(free, start, 1), top)  # the node it takes plus those busy at its start
        s = draws[level - 1][used[level - 1]]
        used[level - 1] += 1
        free.pop(0)
        bisect.insort(free, start + s)
        if i >= skip:
            waits.append(wait)
            waited += wait > 0
            busy += s
    return _result(arrivals, skip, nodes, waits, waited, timed_out, busy, quantile)


def _result(arrivals: list[float], skip: int, nodes: int, waits: list[float], waited: int, timed_out: int, busy: float,
            quantile: float) -> SimResult:
    counted = len(arrivals) - skip
    span = arrivals[-1] - arrivals[skip]
    served = np.asarray(waits) if waits else np.zeros(1)
    return SimResult(
        nodes=nodes,
        requests=counted,
        utilisation=busy / (nodes * span) if span > 0 else 0.0,
        p_wait=waited / counted,
        mean_wait_s=float(served.mean()),
        p99_wait_s=float(np.quantile(served, quantile)),
        p_timeout=timed_out / counted,
    )
