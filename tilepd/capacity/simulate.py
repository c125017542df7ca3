"""Discrete-event check of the closed forms: FIFO, c batch=1 nodes, Poisson arrivals, the router's queue timeout.

The router hands a freed node to the oldest waiter and a waiter leaves after exactly
`queue_timeout_s` (429 or the native pool). With FIFO and a fixed patience the
simulation needs no event list: requests are taken in arrival order, each starts on the
node that frees first, and one that would start after its timeout leaves without taking
a node. Seeded and bounded (`requests`), so a run is reproducible and takes well under a
second per 100k requests.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
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
             by_busy: Sequence[float] | None = None) -> SimResult:
    """Run `requests` Poisson arrivals at `rate`/s through `nodes` FIFO batch=1 nodes; the first `warmup` share is not counted.

    With `by_busy` (mean service times with 1, 2, ... nodes busy; the last stands for every count above), nodes slow
    each other down: a request's work is drawn from `service` scaled to mean 1, and while k nodes are busy every
    request in service gets through it at 1 / by_busy[k-1] per second, as the router's per-level counters measure it.
    """
    if rate <= 0 or nodes < 1:
        raise ValueError(f"simulate needs rate > 0 and nodes >= 1, got rate={rate}, nodes={nodes}")
    if not 1000 <= requests <= MAX_REQUESTS:
        raise ValueError(f"requests must be in [1000, {MAX_REQUESTS}], got {requests}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, requests)).tolist()
    if by_busy:
        if min(by_busy) <= 0:
            raise ValueError(f"the service time at every busy level must be > 0, got {list(by_busy)}")
        work = (service.sample(rng, requests) / service.mean).tolist()
        return _simulate_by_busy(arrivals, work, by_busy, nodes, timeout_s, warmup, quantile)
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


def _simulate_by_busy(arrivals: list[float], work: list[float], level_means: Sequence[float], nodes: int, timeout_s: float,
                      warmup: float, quantile: float) -> SimResult:
    """The FIFO run with the speed of service set by the busy count: an event loop over arrivals and completions.

    Every request in service progresses at the same rate, so one virtual clock `v` (work done per request since the
    start) and a heap of the virtual times at which each finishes give the next completion in O(log c)."""
    requests = len(arrivals)
    skip = int(requests * warmup)
    lo, hi = arrivals[skip], arrivals[-1]  # the counted span, for the utilisation
    top = len(level_means)
    in_service: list[float] = []  # heap of virtual finish times
    queue: deque[int] = deque()
    v = now = 0.0
    waits: list[float] = []
    waited = timed_out = 0
    busy = 0.0  # node-seconds inside the counted span
    i = 0

    def start(j: int) -> None:
        nonlocal waited
        heapq.heappush(in_service, v + work[j])
        if j >= skip:
            wait = now - arrivals[j]
            waits.append(wait)
            waited += wait > 0

    while i < requests or in_service:
        speed = 1.0 / level_means[min(len(in_service), top) - 1] if in_service else 0.0
        done_at = now + (in_service[0] - v) / speed if in_service else math.inf
        t = arrivals[i] if i < requests and arrivals[i] <= done_at else done_at
        busy += len(in_service) * max(0.0, min(t, hi) - max(now, lo))
        if in_service:
            v += (t - now) * speed
        now = t
        if t != done_at:  # an arrival
            if len(in_service) < nodes:
                start(i)
            else:
                queue.append(i)
            i += 1
            continue
        v = heapq.heappop(in_service)  # exact: no drift from the float steps above
        while queue and len(in_service) < nodes:
            j = queue.popleft()
            if now - arrivals[j] > timeout_s:  # it left at its timeout: 429 or the native pool
                if j >= skip:
                    timed_out += 1
                    waited += 1
                continue
            start(j)
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
