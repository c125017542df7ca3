"""Service time that depends on how many decode nodes are busy: when to model it, and with what.

Decode nodes that share a host (CPU cores, one prefill instance, a memory bus) slow each other
down: on a 2-core box a request alone held its node ~113 ms, next to another ~215 ms. The queue
forms exactly when every node is busy, so it drains at the slow rate, and an M/G/c model with
the overall mean service time understates the tail. The router records each lease's hold by the
nodes leased when it was granted (`tilepd_router_lease_hold_by_busy_seconds{busy}`); this module
turns those histograms into per-level distributions, or says why the independent-node model is
kept (means agree, or too few leases per level to tell).
"""

from __future__ import annotations

from dataclasses import dataclass

from tilepd.capacity.simulate import ServiceTimes
from tilepd.capacity.sources import Histogram

MIN_PER_LEVEL = 50  # leases a level needs before its mean counts
AGREE = 0.15  # per-level means within this of each other: independent nodes


@dataclass(frozen=True)
class BusyLevels:
    """`levels[k-1]`: the service time of a request that started with k nodes busy (itself included); the last level
    also stands for every count above it. `counts[k-1]` is what was measured there (0: filled from the nearest
    measured level)."""

    levels: tuple[ServiceTimes, ...]
    counts: tuple[float, ...]

    def at(self, busy: int) -> ServiceTimes:
        return self.levels[min(max(busy, 1), len(self.levels)) - 1]

    def means(self, nodes: int) -> list[float]:
        """E[S | k busy] for k = 1..nodes (counts above the top level take the top level's)."""
        return [self.at(k).mean for k in range(1, nodes + 1)]

    @property
    def top(self) -> int:
        return len(self.levels)

    def describe(self) -> str:
        parts = [f"{_ms(d.mean)} {'alone' if k == 1 else f'with {k} busy'}" + ("" if n else " (not measured: nearest level's)")
                 for k, (d, n) in enumerate(zip(self.levels, self.counts), 1)]
        return ", ".join(parts)

    def as_list(self) -> list[dict[str, float | int | str]]:
        return [{"busy": k, "mean_s": d.mean, "cv": d.cv, "count": n, "distribution": d.describe()}
                for k, (d, n) in enumerate(zip(self.levels, self.counts), 1)]


def _ms(v: float) -> str:
    return f"{v * 1e3:.0f} ms"


def _level(label: str) -> int:
    return int(label.rstrip("+"))


def busy_model(hists: dict[str, Histogram] | None, *, min_count: float = MIN_PER_LEVEL,
               agree: float = AGREE) -> tuple[BusyLevels | None, list[str]]:
    """The per-level service times when they differ by more than `agree` over levels with `min_count` leases or more;
    else None (independent nodes). Notes say which and why; `hists` None: the router does not record them."""
    if hists is None:
        return None, ["the router does not record the lease hold by busy nodes (older tilepd): independent nodes assumed"]
    by_level = {_level(k): h for k, h in hists.items() if h.count > 0}
    if not by_level:
        return None, ["no lease ended in the window at any busy level: independent nodes assumed"]
    measured = {k: h for k, h in by_level.items() if h.count >= min_count}
    seen = ", ".join(f"{_ms(h.mean)} at {k} busy (n {h.count:g})" for k, h in sorted(by_level.items()))
    if len(measured) < 2:
        return None, [f"service time by busy nodes: {seen}; fewer than {min_count:g} leases on all but one level, too few to "
                      "tell whether the nodes slow each other down: independent nodes assumed"]
    means = [h.mean for h in measured.values()]
    if max(means) <= (1 + agree) * min(means):
        return None, [f"service time by busy nodes: {seen}: within {agree:.0%} of each other, independent nodes (M/G/c)"]
    top = max(measured)
    keys = sorted(measured)
    levels, counts = [], []
    for k in range(1, top + 1):
        src = k if k in measured else min(keys, key=lambda m: (abs(m - k), -m))  # nearest measured, the slower on a tie
        levels.append(measured[src].distribution())
        counts.append(measured[k].count if k in measured else 0.0)
    bl = BusyLevels(tuple(levels), tuple(counts))
    lo, hi = measured[keys[0]], measured[keys[-1]]
    slower = hi.mean > lo.mean
    notes = [f"service time {bl.describe()}: the nodes {'slow each other down (they share a host: CPU cores, a prefill instance)' if slower else 'are faster together'}; "
             "modelled as a state-dependent queue (service time by the busy nodes at a request's start; formula: a birth-death "
             "chain with the full pool's hand-over rate once all are busy, docs/CAPACITY.md)",
             f"at other pool sizes a request starting with k nodes busy is taken to last as measured here at k; more than {top} "
             f"busy take the {top}-busy figure ({_ms(bl.levels[-1].mean)}): right when the nodes share one host as here, "
             "pessimistic when added nodes get hosts of their own, optimistic if the slowdown keeps growing past what was measured"]
    return bl, notes
