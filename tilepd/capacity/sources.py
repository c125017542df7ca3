"""The load, read from the services' Prometheus /metrics (prometheus_client's own text parser).

Router (`tilepd_router_*`, counters since start, so two scrapes `window_s` apart):
arrivals at the decode-node queue = leases granted (`lease_wait_seconds_count`) + requests
that waited out the queue timeout (`routes_total{reason="busy"}`: route `low_latency` is a
429, route `native` a fallback); service time = `lease_hold_seconds` (a node held from
lease to release). Decode nodes: seconds per token = `tilepd_decode_decode_seconds_sum /
tilepd_decode_tokens_total`. Prefill (stock vLLM): prefill_fit.py.

Several routers over the same decode nodes each count their own requests: `combined` sums them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tilepd.capacity.simulate import Empirical

Labels = tuple[tuple[str, str], ...]


class MetricsUnreachable(Exception):
    """A /metrics endpoint did not answer (the URL and the reason are in the message)."""


class MetricsInvalid(Exception):
    """A /metrics answer lacks what the estimate needs, or cannot be parsed."""


@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram: finite upper bounds, cumulative counts (the +Inf bucket last), sum, count."""

    edges: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float
    count: float

    def __sub__(self, before: Histogram) -> Histogram:
        if before.edges != self.edges:
            raise MetricsInvalid("histogram buckets changed between the two scrapes (was the service upgraded?)")
        return Histogram(self.edges, tuple(a - b for a, b in zip(self.cumulative, before.cumulative)),
                         self.sum - before.sum, self.count - before.count)

    def __add__(self, other: Histogram) -> Histogram:
        if other.edges != self.edges:
            raise MetricsInvalid("the routers' histograms have different buckets (routers of different tilepd versions?)")
        return Histogram(self.edges, tuple(a + b for a, b in zip(self.cumulative, other.cumulative)), self.sum + other.sum,
                         self.count + other.count)

    @property
    def counts(self) -> tuple[float, ...]:
        """Per-bucket counts (not cumulative), the +Inf bucket last."""
        return tuple(c - p for c, p in zip(self.cumulative, (0.0, *self.cumulative[:-1])))

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count > 0 else math.nan

    def quantile(self, q: float) -> float:
        """Prometheus' histogram_quantile: linear inside the bucket; the last finite edge when it falls in +Inf."""
        if self.count <= 0:
            return math.nan
        rank = q * self.count
        lower, below = 0.0, 0.0
        for edge, cum in zip(self.edges, self.cumulative):
            if cum >= rank:
                inside = cum - below
                return lower + (edge - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = edge, cum
        return self.edges[-1]

    def fraction_above(self, t: float) -> float:
        """Share of observations above the bucket edge nearest `t` (from above)."""
        if self.count <= 0:
            return math.nan
        for edge, cum in zip(self.edges, self.cumulative):
            if edge >= t:
                return 1.0 - cum / self.count
        return 1.0 - self.cumulative[-2] / self.count if len(self.cumulative) > 1 else 0.0

    def distribution(self) -> Empirical:
        return Empirical(self.edges, self.counts, self.mean)


@dataclass
class Scrape:
    """Every sample of one /metrics answer: name -> {labels: value}."""

    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)
    families: set[str] = field(default_factory=set)  # every metric named, with samples or not (a labelled one may have none yet)

    @classmethod
    def parse(cls, text: str, source: str = "/metrics") -> Scrape:
        out = cls()
        try:
            for family in text_string_to_metric_families(text):
                out.families.add(family.name)
                for s in family.samples:
                    out.samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
        except ValueError as exc:
            raise MetricsInvalid(f"{source}: not Prometheus text exposition: {exc}") from None
        return out

    def has(self, name: str) -> bool:
        return name in self.samples

    def total(self, name: str, **match: str) -> float:
        """Sum of the samples of `name` whose labels include `match` (0 when none)."""
        return sum(v for labels, v in self.samples.get(name, {}).items() if all((k, w) in labels for k, w in match.items()))

    def by_labels(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {}
        for labels, v in self.samples.get(name, {}).items():
            d = dict(labels)
            key = tuple(d.get(k, "") for k in keys)
            out[key] = out.get(key, 0.0) + v
        return out

    def histogram(self, name: str, **match: str) -> Histogram | None:
        buckets = self.samples.get(f"{name}_bucket")
        if not buckets:
            return None
        by_le: dict[float, float] = {}
        for labels, v in buckets.items():
            d = dict(labels)
            if all(d.get(k) == w for k, w in match.items()):
                le = float(d["le"])
                by_le[le] = by_le.get(le, 0.0) + v
        if not by_le:
            return None
        les = sorted(by_le)
        finite = tuple(le for le in les if math.isfinite(le))
        return Histogram(finite, tuple(by_le[le] for le in les), self.total(f"{name}_sum", **match), self.total(f"{name}_count", **match))


def scrape(url: str, timeout_s: float = 5.0) -> Scrape:
    """GET `url` (a /metrics endpoint) and parse it."""
    try:
        r = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise MetricsUnreachable(f"{url}: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        raise MetricsUnreachable(f"{url}: HTTP {r.status_code}")
    return Scrape.parse(r.text, url)


@dataclass(frozen=True)
class RouterLoad:
    """What the router saw in one window."""

    window_s: float
    arrivals: float  # requests that queued for a decode node (leased or timed out)
    leased: float
    busy_429: float  # timed out, refused (no native pool)
    busy_fallback: float  # timed out, sent to the native pool
    routes: dict[str, float]  # "pool/reason" -> requests
    service: Histogram  # node service times of the leases that ended in the window
    service_source: str  # which series the service time came from
    wait: Histogram
    nodes_in_rotation: int | None
    notes: tuple[str, ...]
    # the pool's time and releases at each busy level ("1", "2", ..., "8+"; levels without a release left out); None
    # for an older router without tilepd_router_pool_releases_total
    busy_levels: dict[str, BusyLevel] | None = None
    # the holds of the leases that ran alone in the window; None for a router without tilepd_router_pool_alone_*
    alone_holds: AloneHolds | None = None

    @property
    def rate(self) -> float:
        return self.arrivals / self.window_s

    @property
    def busy_fraction(self) -> float:
        return (self.busy_429 + self.busy_fallback) / self.arrivals if self.arrivals else 0.0

    def measured_utilisation(self, nodes: int) -> float:
        return self.service.sum / (self.window_s * nodes)


@dataclass(frozen=True)
class BusyLevel:
    """One busy level of the pool over a window: seconds spent there, node-seconds leased there, releases made there."""

    seconds: float
    node_seconds: float
    releases: float

    @property
    def mean_service_s(self) -> float:
        """The mean service time at this level: the chain's completion rate there is releases / seconds, i.e. each of
        the k busy nodes completes at releases / node_seconds."""
        return self.node_seconds / self.releases if self.releases > 0 else math.nan


@dataclass(frozen=True)
class AloneHolds:
    """The leases of a window that had the pool to themselves: their count, the sum of their holds and of the squares.

    Alone, a request's speed is not shared with another lease, so the spread of these holds is the spread of the
    requests' own work (tokens, prompt lengths); with company, the holds also spread with how the host's time is
    split between the leases, which does not slow the pool's hand-overs (docs/CAPACITY.md)."""

    releases: float
    seconds: float
    squared: float

    @property
    def mean_s(self) -> float:
        return self.seconds / self.releases if self.releases > 0 else math.nan

    @property
    def cv(self) -> float:
        if self.releases <= 0 or self.seconds <= 0:
            return math.nan
        mean = self.seconds / self.releases
        return max(self.squared / self.releases / (mean * mean) - 1.0, 0.0) ** 0.5


ROUTES = "tilepd_router_routes_total"
HOLD = "tilepd_router_lease_hold_seconds"
BUSY_SECONDS = "tilepd_router_pool_busy_seconds_total"
BUSY_NODE_SECONDS = "tilepd_router_pool_busy_node_seconds_total"
RELEASES = "tilepd_router_pool_releases_total"
ALONE_RELEASES = "tilepd_router_pool_alone_releases_total"
ALONE_SECONDS = "tilepd_router_pool_alone_hold_seconds_total"
ALONE_SQUARED = "tilepd_router_pool_alone_hold_seconds_squared_total"
WAIT = "tilepd_router_lease_wait_seconds"
REQUEST = "tilepd_router_request_seconds"


def router_load(before: Scrape, after: Scrape, window_s: float) -> RouterLoad:
    """The router's counters over a window (`after` minus `before`)."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    w_after, w_before = after.histogram(WAIT), before.histogram(WAIT)
    if w_after is None or w_before is None:
        raise MetricsInvalid(f"the router's /metrics has no {WAIT}: is this a tilepd router?")
    notes: list[str] = []
    wait = w_after - w_before
    routes_a, routes_b = after.by_labels(ROUTES, "route", "reason"), before.by_labels(ROUTES, "route", "reason")
    routes = {f"{p}/{r}": v - routes_b.get((p, r), 0.0) for (p, r), v in routes_a.items() if v - routes_b.get((p, r), 0.0) > 0}
    busy_429 = routes.get("low_latency/busy", 0.0)
    busy_fallback = routes.get("native/busy", 0.0)
    h_after, h_before = after.histogram(HOLD), before.histogram(HOLD)
    if h_after is not None and h_before is not None:
        service, source = h_after - h_before, HOLD
    else:
        r_after, r_before = after.histogram(REQUEST, route="low_latency"), before.histogram(REQUEST, route="low_latency")
        if r_after is None:
            raise MetricsInvalid(f"the router's /metrics has neither {HOLD} nor {REQUEST}{{route=\"low_latency\"}}")
        # a labelled series appears with its first observation: absent before the window means zero
        service, source = r_after - r_before if r_before is not None else r_after, f'{REQUEST}{{route="low_latency"}}'
        notes.append(f"this router has no {HOLD} (older tilepd): service time taken from {source}, which also counts "
                     "the queue wait and refused requests, so it overstates the service time")
    gauge = after.samples.get("tilepd_router_nodes_in_rotation")
    in_rotation = int(sum(gauge.values())) if gauge else None
    return RouterLoad(window_s, wait.count + busy_429 + busy_fallback, wait.count, busy_429, busy_fallback, routes, service,
                      source, wait, in_rotation, tuple(notes), busy_levels(before, after), alone_holds(before, after))


def combined(loads: list[RouterLoad]) -> RouterLoad:
    """Several routers' windows over the same decode nodes as one: arrivals, routes, holds and waits summed. Each router
    counts only its own leases at each busy level (another router's hold looks like a free node to it), so the busy
    levels and the holds that ran alone are left out: the estimate takes the nodes as independent (M/G/c)."""
    first, rest = loads[0], loads[1:]
    routes: dict[str, float] = {}
    for load in loads:
        for k, v in load.routes.items():
            routes[k] = routes.get(k, 0.0) + v
    service, wait = first.service, first.wait
    for load in rest:
        service, wait = service + load.service, wait + load.wait
    rotation = [load.nodes_in_rotation for load in loads if load.nodes_in_rotation is not None]
    notes = [n for load in loads for n in load.notes]
    notes.append(f"{len(loads)} routers: their requests, holds and waits summed; each sees only its own leases per busy level, "
                 "so the nodes are taken as independent (M/G/c)")
    return RouterLoad(first.window_s, sum(x.arrivals for x in loads), sum(x.leased for x in loads), sum(x.busy_429 for x in loads),
                      sum(x.busy_fallback for x in loads), routes, service, first.service_source, wait,
                      max(rotation) if rotation else None, tuple(dict.fromkeys(notes)))


def busy_levels(before: Scrape, after: Scrape) -> dict[str, BusyLevel] | None:
    """The window's time, node-seconds and releases per `busy` label (a label first seen after `before` counts from
    zero); levels without a release in the window left out. None: the router does not export them (older tilepd)."""
    if RELEASES.removesuffix("_total") not in after.families:  # a family without samples is still named
        return None

    def delta(name: str) -> dict[str, float]:
        a, b = after.by_labels(name, "busy"), before.by_labels(name, "busy")
        return {k[0]: v - b.get(k, 0.0) for k, v in a.items()}

    seconds, node_seconds, releases = delta(BUSY_SECONDS), delta(BUSY_NODE_SECONDS), delta(RELEASES)
    return {k: BusyLevel(seconds.get(k, 0.0), node_seconds.get(k, 0.0), n) for k, n in releases.items() if n > 0}


def alone_holds(before: Scrape, after: Scrape) -> AloneHolds | None:
    """The window's leases that ran alone (counters absent before the window count from zero); None: an older router."""
    if ALONE_RELEASES.removesuffix("_total") not in after.families:
        return None

    return AloneHolds(*(after.total(name) - before.total(name) for name in (ALONE_RELEASES, ALONE_SECONDS, ALONE_SQUARED)))


def seconds_per_token(scrapes: list[Scrape]) -> float | None:
    """Decode nodes: engine decode seconds per generated token since they started (None: no token yet)."""
    secs = sum(s.total("tilepd_decode_decode_seconds_sum") for s in scrapes)
    tokens = sum(s.total("tilepd_decode_tokens_total") for s in scrapes)
    return secs / tokens if tokens > 0 else None
