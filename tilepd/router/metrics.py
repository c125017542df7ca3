"""Prometheus metrics of the router: routes and their reasons, latencies, leases, node health."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tilepd.router.leases import NodePool, NodeState

log = logging.getLogger("tilepd.router")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# a decode node's service time (lease held): ~12% steps from 5 ms to 5 min, fine enough for `tilepd capacity`'s simulation
_HOLD_BUCKETS = tuple(round(0.005 * 1.125 ** i, 5) for i in range(95))
# queue waits: a zero-wait bucket, then ~20% steps to 2 min, so a measured p99 wait is good to ~10% (`tilepd capacity`)
_WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, *(round(0.01 * 1.2 ** i, 5) for i in range(53)))
# the pool's busy levels are labelled 0 .. BUSY_LABEL_CAP - 1, then "<cap>+": bounded cardinality on any pool size
BUSY_LABEL_CAP = 8


def busy_label(busy: int) -> str:
    """The `busy` label of the state with `busy` nodes leased."""
    return f"{BUSY_LABEL_CAP}+" if busy >= BUSY_LABEL_CAP else str(max(busy, 0))


class BusyTimeCollector(Collector):
    """The pool as a birth-death chain, read at scrape time: seconds with k nodes leased and the releases made from k;
    and the holds of the leases that ran alone, whose spread is the spread of the requests' own work.

    On a shared host a node's service time grows with its busy neighbours; releases / seconds at level k is the pool's
    completion rate with k busy, which `tilepd capacity` fits (docs/CAPACITY.md)."""

    def __init__(self, pool: NodePool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[CounterMetricFamily]:
        seconds, releases = self._pool.busy_time()
        node_seconds = {k: k * v for k, v in seconds.items()}
        t = CounterMetricFamily("tilepd_router_pool_busy_seconds", "Seconds the decode pool spent with this many nodes leased", labels=["busy"])
        ns = CounterMetricFamily("tilepd_router_pool_busy_node_seconds", "Node-seconds leased while this many nodes were leased", labels=["busy"])
        r = CounterMetricFamily("tilepd_router_pool_releases", "Leases released while this many nodes were leased (the one released included)",
                                labels=["busy"])
        for family, values in ((t, seconds), (ns, node_seconds), (r, releases)):
            merged: dict[str, float] = {}
            for k, v in values.items():
                merged[busy_label(k)] = merged.get(busy_label(k), 0.0) + v
            for label in sorted(merged, key=lambda x: int(x.rstrip("+"))):
                family.add_metric([label], merged[label])
            yield family
        n, total, squares = self._pool.alone_holds()
        for name, doc, value in (
                ("tilepd_router_pool_alone_releases", "Leases that ended having had the pool to themselves (no other node leased meanwhile)", n),
                ("tilepd_router_pool_alone_hold_seconds", "Sum of those leases' holds: a request's length at one fixed speed", total),
                ("tilepd_router_pool_alone_hold_seconds_squared", "Sum of the squares of those holds (their spread, for tilepd capacity)",
                 squares)):
            yield CounterMetricFamily(name, doc, value=value)


class RouterMetrics:
    """One registry per router (so several routers can live in one test process)."""

    def __init__(self, pool: NodePool, breaker_failures: int) -> None:
        self.registry = CollectorRegistry()
        self.breaker_failures = breaker_failures
        r = self.registry
        self.routes = Counter("tilepd_router_routes", "Requests by the pool that served them and why", ["route", "reason"], registry=r)
        self.responses = Counter("tilepd_router_responses", "Responses by route and HTTP status", ["route", "status"], registry=r)
        self.request_seconds = Histogram("tilepd_router_request_seconds", "Time from request to last byte", ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("tilepd_router_ttft_seconds", "Time to the first token (low-latency pool)", buckets=_LATENCY_BUCKETS, registry=r)
        self.lease_wait_seconds = Histogram("tilepd_router_lease_wait_seconds", "Time waited for a decode node", buckets=_WAIT_BUCKETS, registry=r)
        self.lease_hold_seconds = Histogram("tilepd_router_lease_hold_seconds", "Time a request held its decode node (the node's service time)",
                                            buckets=_HOLD_BUCKETS, registry=r)
        pool.on_release = self.observe_hold
        r.register(BusyTimeCollector(pool))
        self.completion_tokens = Counter("tilepd_router_completion_tokens", "Tokens generated (low-latency pool)", registry=r)
        # the request timeline (timeline.py), one observation per phase a request went through (repeats summed)
        self.phase_seconds = Histogram("tilepd_router_phase_seconds", "Time per request in each phase of its timeline, by route",
                                       ["phase", "route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.failovers = Counter("tilepd_router_failovers", "Requests moved to another node after a decode-node fault, by cause", ["cause"], registry=r)
        self.decode_errors = Counter("tilepd_router_decode_errors", "Decode node errors by node and code", ["node", "code"], registry=r)
        self.reservation_refusals = Counter("tilepd_router_reservation_refusals", "Reservations a decode node refused, by node "
                                            "and code (busy: another router holds it)", ["node", "code"], registry=r)
        self.breaker = Counter("tilepd_router_breaker_transitions", "Decode nodes leaving (open) or rejoining (closed) rotation", ["node", "state"], registry=r)
        # the divergence watch (divergence_watch.py): teacher-forced checks of nodes' tokens by the prefill pool
        self.divergence_checks = Counter("tilepd_router_divergence_checks", "Teacher-forced checks of a node's tokens by the prefill, "
                                         "by node and verdict (agree, diverged, error)", ["node", "verdict"], registry=r)
        self.divergence_worst_gap = Gauge("tilepd_router_divergence_worst_gap_nats", "How far below the prefill's top-1 the least "
                                          "likely token of the node's last check was (nats; 0: every token the top-1)", ["node"], registry=r)
        Gauge("tilepd_router_queue_depth", "Requests waiting for a decode node", registry=r).set_function(lambda: pool.queue_depth)
        Gauge("tilepd_router_nodes_in_rotation", "Decode nodes that can be leased", registry=r).set_function(lambda: len(pool.in_rotation()))
        Gauge("tilepd_router_nodes_leased", "Decode nodes held by a request", registry=r).set_function(pool.leased_count)
        Gauge("tilepd_router_nodes_held_elsewhere", "Decode nodes whose slot another router holds (their last answer)",
              registry=r).set_function(lambda: sum(1 for n in pool.nodes if n.held_by is not None))

    def observe_hold(self, held_s: float) -> None:
        """One released lease: its service time."""
        self.lease_hold_seconds.observe(held_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def node_failure(self, pool: NodePool, node: NodeState, why: str) -> None:
        """Count a failed health check or call; open the breaker after `breaker_failures` in a row."""
        node.consecutive_failures += 1
        node.last_error = why
        if node.in_rotation and node.consecutive_failures >= self.breaker_failures:
            pool.set_in_rotation(node, False)
            self.breaker.labels(node.name, "open").inc()
            log.warning("event=node_out_of_rotation node=%s failures=%d runbook=RB-decode-down last_error=%s", node.name, node.consecutive_failures, why)

    def node_down(self, pool: NodePool, node: NodeState, why: str) -> None:
        """A request saw the node fail (refused, reset, silent): out of rotation at once; the health checks bring it back."""
        node.consecutive_failures = max(node.consecutive_failures + 1, self.breaker_failures)
        node.last_error = why
        if node.in_rotation:
            pool.set_in_rotation(node, False)
            self.breaker.labels(node.name, "open").inc()
            log.warning("event=node_out_of_rotation node=%s failures=%d runbook=RB-decode-down last_error=%s", node.name, node.consecutive_failures, why)

    def node_ok(self, pool: NodePool, node: NodeState) -> None:
        node.consecutive_failures = 0
        if not node.in_rotation:
            pool.set_in_rotation(node, True)
            self.breaker.labels(node.name, "closed").inc()
            log.info("event=node_in_rotation node=%s", node.name)
