"""One capacity estimate: a load, the formula and the simulation at each pool size, the nodes needed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tilepd.capacity.busy import BusyLevels
from tilepd.capacity.queueing import Prediction, meets, predict, predict_by_busy
from tilepd.capacity.simulate import GammaTimes, ServiceTimes, SimResult, simulate


@dataclass(frozen=True)
class Load:
    """Requests/s reaching the decode-node queue, their service times on a node, the router's queue timeout."""

    rate: float
    service: ServiceTimes
    timeout_s: float
    source: str  # "live router window ..." or "stated ..."
    by_busy: BusyLevels | None = None  # mean service time by the busy nodes; None: independent nodes (M/G/c)

    @property
    def model(self) -> str:
        return "state-dependent" if self.by_busy is not None else "independent"

    def formula(self, nodes: int) -> Prediction:
        """The closed form at `nodes` nodes: M/G/c+D, or the birth-death chain when the service time depends on the busy nodes."""
        if self.by_busy is None:
            return predict(self.rate, self.service.mean, self.service.cv, nodes, self.timeout_s)
        return predict_by_busy(self.rate, self.by_busy.means(nodes), self.by_busy.work_cv(self.service.cv), nodes, self.timeout_s)

    def simulation(self, nodes: int, requests: int, seed: int) -> SimResult:
        """With `by_busy`, a request's work has the CV of the holds less their speed mix (gamma), its speed follows
        the busy count; otherwise its service time is drawn from `service`."""
        if self.by_busy is None:
            return simulate(self.rate, self.service, nodes, self.timeout_s, requests=requests, seed=seed)
        work = GammaTimes(1.0, self.by_busy.work_cv(self.service.cv))
        return simulate(self.rate, work, nodes, self.timeout_s, requests=requests, seed=seed, by_busy=self.by_busy.means_s)


@dataclass(frozen=True)
class Targets:
    p99_wait_s: float
    fallback: float  # highest acceptable share of requests that wait past the queue timeout (429 or native)


@dataclass(frozen=True)
class Row:
    formula: Prediction
    simulation: SimResult

    @property
    def nodes(self) -> int:
        return self.formula.nodes

    def meets(self, t: Targets) -> bool:
        """Both the closed form and the simulation meet both targets."""
        s = self.simulation
        return meets(self.formula, t.p99_wait_s, t.fallback) and s.p99_wait_s <= t.p99_wait_s and s.p_timeout <= t.fallback


@dataclass
class Estimate:
    load: Load
    targets: Targets
    current_nodes: int
    needed_formula: int
    needed: int  # formula and simulation both meet the targets
    rows: list[Row] = field(default_factory=list)

    def row(self, nodes: int) -> Row:
        return next(r for r in self.rows if r.nodes == nodes)

    def as_dict(self) -> dict[str, Any]:
        def one(r: Row) -> dict[str, Any]:
            return {"nodes": r.nodes, "formula": r.formula.as_dict(), "simulation": r.simulation.as_dict(), "meets_targets": r.meets(self.targets)}

        svc = self.load.service
        return {
            "load": {"source": self.load.source, "rate_per_s": self.load.rate, "service_mean_s": svc.mean, "service_cv": svc.cv,
                     "service_distribution": svc.describe(), "offered_load_erlangs": self.load.rate * svc.mean,
                     "queue_timeout_s": self.load.timeout_s, "model": self.load.model,
                     "service_by_busy": self.load.by_busy.as_list() if self.load.by_busy is not None else None,
                     "work_cv": self.load.by_busy.work_cv(svc.cv) if self.load.by_busy is not None else None,
                     "work_cv_source": (None if self.load.by_busy is None else
                                        "alone" if self.load.by_busy.alone_work_cv is not None else "holds less level mix")},
            "targets": {"p99_wait_s": self.targets.p99_wait_s, "fallback": self.targets.fallback},
            "current": one(self.row(self.current_nodes)),
            "nodes_needed": self.needed,
            "nodes_needed_formula": self.needed_formula,
            "rows": [one(r) for r in self.rows],
        }


def nodes_needed(load: Load, targets: Targets, max_nodes: int = 4096) -> int:
    """The fewest nodes whose closed-form p99 wait and timeout fraction meet both targets."""
    for c in range(1, max_nodes + 1):
        if meets(load.formula(c), targets.p99_wait_s, targets.fallback):
            return c
    raise ValueError(f"more than {max_nodes} nodes would be needed for {load.rate:g} req/s at {load.service.mean:g} s each")


MAX_SEARCH = 64  # nodes past the formula's answer the simulation may ask for


def estimate(load: Load, targets: Targets, current_nodes: int, *, sim_requests: int = 100_000, seed: int = 0) -> Estimate:
    """Formula and simulation at the current size and around the size needed.

    `needed` is the fewest nodes at which both the formula and the simulation meet the targets:
    the formula alone can be optimistic when the service-time CV is far from 1 (its correction
    is an approximation), the simulation alone carries sampling noise.
    """
    if current_nodes < 1:
        raise ValueError(f"the pool needs at least one decode node, got {current_nodes}")
    rows: dict[int, Row] = {}

    def at(c: int) -> Row:
        if c not in rows:
            rows[c] = Row(load.formula(c), load.simulation(c, sim_requests, seed))
        return rows[c]

    by_formula = nodes_needed(load, targets)
    at(current_nodes)
    c = by_formula
    while not at(c).meets(targets):
        c += 1
        if c > by_formula + MAX_SEARCH:
            raise ValueError(f"the simulation still misses the targets at {c} nodes (formula: {by_formula}); check the service-time data")
    for extra in (c - 1, c + 1):  # the neighbours, to show the margin
        if extra >= 1:
            at(extra)
    return Estimate(load, targets, current_nodes, by_formula, c, [rows[k] for k in sorted(rows)])
