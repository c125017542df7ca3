"""Service time that depends on how many decode nodes are busy: when to model it, and with what.

Decode nodes that share a host (CPU cores, one prefill instance, a memory bus) slow each other
down: on a 2-core box a request alone held its node ~113 ms, next to another ~215 ms. The queue
forms exactly when every node is busy, so it drains at the slow rate, and an M/G/c model with
the overall mean service time understates the tail. The router records the pool as a birth-death
chain (`tilepd_router_pool_busy_node_seconds_total{busy}` and `tilepd_router_pool_releases_total{busy}`):
releases / node-seconds at level k is each busy node's completion rate there, the chain's
maximum-likelihood estimate whatever the requests' lengths. This module turns those counters into
per-level mean service times, or says why the independent-node model is kept (means agree, or too
few releases per level to tell).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tilepd.capacity.sources import AloneHolds, BusyLevel

MIN_PER_LEVEL = 50  # releases a level needs before its mean counts
AGREE = 0.15  # per-level means within this of each other: independent nodes


@dataclass(frozen=True)
class BusyLevels:
    """`means_s[k-1]`: the mean service time of a request while k nodes are busy (itself included), i.e. each busy node
    completes at 1 / means_s[k-1] there; the last level also stands for every count above it. `releases[k-1]` is what
    was measured there (0: filled from the nearest measured level)."""

    means_s: tuple[float, ...]
    releases: tuple[float, ...]
    alone_work_cv: float | None = None  # the work's CV measured on the leases that ran alone (enough of them), else None

    def at(self, busy: int) -> float:
        return self.means_s[min(max(busy, 1), len(self.means_s)) - 1]

    def means(self, nodes: int) -> list[float]:
        """E[S | k busy] for k = 1..nodes (counts above the top level take the top level's)."""
        return [self.at(k) for k in range(1, nodes + 1)]

    @property
    def top(self) -> int:
        return len(self.means_s)

    def describe(self) -> str:
        parts = [f"{_ms(m)} {'alone' if k == 1 else f'with {k} busy'}" + ("" if n else " (not measured: nearest level's)")
                 for k, (m, n) in enumerate(zip(self.means_s, self.releases), 1)]
        return ", ".join(parts)

    def work_cv(self, hold_cv: float) -> float:
        """The CV of a request's work (its length at one fixed speed): measured on the leases that ran alone when there
        were enough, else from the CV of the holds less their level mix (weighted by releases),
        (1 + CV_hold^2) = (1 + CV_work^2)(1 + CV_mix^2). The fallback overstates the work's spread where the holds also
        spread within a level (a shared host splitting its time unevenly between the leases: 0.45 against 0.20 alone
        on the 2-core check box), which lengthens the predicted tail (docs/CAPACITY.md)."""
        if self.alone_work_cv is not None:
            return self.alone_work_cv
        n = sum(self.releases)
        if n <= 0:
            return hold_cv
        mean = sum(r * m for r, m in zip(self.releases, self.means_s)) / n
        mix = sum(r * (m - mean) ** 2 for r, m in zip(self.releases, self.means_s)) / (n * mean * mean)
        return max((1 + hold_cv**2) / (1 + mix) - 1, 0.0) ** 0.5

    def as_list(self) -> list[dict[str, float | int]]:
        return [{"busy": k, "mean_s": m, "releases": n} for k, (m, n) in enumerate(zip(self.means_s, self.releases), 1)]


def _ms(v: float) -> str:
    return f"{v * 1e3:.0f} ms"


def _level(label: str) -> int:
    return int(label.rstrip("+"))


def busy_model(levels: dict[str, BusyLevel] | None, alone: AloneHolds | None = None, *, min_count: float = MIN_PER_LEVEL,
               agree: float = AGREE) -> tuple[BusyLevels | None, list[str]]:
    """The per-level mean service times when they differ by more than `agree` over levels with `min_count` releases or
    more; else None (independent nodes). With `min_count` leases or more that ran `alone`, their holds' CV is the
    work's. Notes say which and why; `levels` None: the router does not record them."""
    if levels is None:
        return None, ["the router does not record its pool's busy levels (older tilepd): independent nodes assumed"]
    by_level = {_level(k): v for k, v in levels.items() if v.releases > 0 and _level(k) > 0}
    if not by_level:
        return None, ["no lease ended in the window at any busy level: independent nodes assumed"]
    measured = {k: v for k, v in by_level.items() if v.releases >= min_count}
    seen = ", ".join(f"{_ms(v.mean_service_s)} at {k} busy (n {v.releases:g})" for k, v in sorted(by_level.items()))
    if len(measured) < 2:
        return None, [f"service time by busy nodes: {seen}; fewer than {min_count:g} releases on all but one level, too few to "
                      "tell whether the nodes slow each other down: independent nodes assumed"]
    means = [v.mean_service_s for v in measured.values()]
    if max(means) <= (1 + agree) * min(means):
        return None, [f"service time by busy nodes: {seen}: within {agree:.0%} of each other, independent nodes (M/G/c)"]
    top = max(measured)
    keys = sorted(measured)
    level_means, counts = [], []
    for k in range(1, top + 1):
        src = k if k in measured else min(keys, key=lambda m: (abs(m - k), -m))  # nearest measured, the slower on a tie
        level_means.append(measured[src].mean_service_s)
        counts.append(measured[k].releases if k in measured else 0.0)
    alone_cv = alone.cv if alone is not None and alone.releases >= min_count and math.isfinite(alone.cv) else None
    bl = BusyLevels(tuple(level_means), tuple(counts), alone_cv)
    slower = measured[keys[-1]].mean_service_s > measured[keys[0]].mean_service_s
    notes = [f"service time {bl.describe()}: the nodes {'slow each other down (they share a host: CPU cores, a prefill instance)' if slower else 'are faster together'}; "
             "modelled as a state-dependent queue (each busy node completes at the rate measured at the current busy count; "
             "formula: a birth-death chain with the full pool's hand-over rate once all are busy, docs/CAPACITY.md)",
             f"at other pool sizes a node with k busy is taken to run as measured here at k; more than {top} "
             f"busy take the {top}-busy figure ({_ms(bl.means_s[-1])}): right when the nodes share one host as here, "
             "pessimistic when added nodes get hosts of their own, optimistic if the slowdown keeps growing past what was measured",
             (f"a request's work (its length at one fixed speed) has CV {alone_cv:.2f}, from the {alone.releases:g} leases "
              "that ran alone" if alone_cv is not None and alone is not None else
              f"fewer than {min_count:g} leases ran alone{'' if alone is not None else ' (older tilepd: not recorded)'}: the "
              "work's CV is taken from the holds' CV less their level mix, which overstates it where a shared host splits "
              "its time unevenly (a longer predicted tail)")]
    return bl, notes
