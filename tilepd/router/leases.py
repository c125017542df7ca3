"""Decode-node leases: one request in flight per node, a bounded FIFO wait for a free one.

A batch=1 decode node serves exactly one request; two would queue inside the node
and wreck both latencies. The router therefore leases whole nodes: a request holds
its node from prefill until the node is idle again (decode ended, was cancelled, or
the slot was released), and waiting requests are served first come, first served,
each for at most the queue timeout. Nodes out of rotation (circuit breaker open) are
never leased; a request that finds no node in rotation fails at once.

A draining node (`tilepd drain`: its /health says so, or it refused a request as
`draining`) is healthy but takes no new lease: the request it serves finishes normally
(its watchdog does not treat draining as a fault), and it counts as out of rotation for
everything that asks which nodes can serve. It comes back when its /health answers 200.

These leases are the router's own bookkeeping: which of its requests uses which node, and who waits. The node's
slot itself is arbitrated by the node (reservations.py reserves it there before the prefill): another router may
hold it. A node whose reservation was refused that way is `held_by` that router, off this pool's free list until
the node says its slot is free again (`back_from_elsewhere`); a waiter that was handed such a node keeps its place at
the head of the queue.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tilepd.contracts.service_configs import DecodeEndpoint


@dataclass
class NodeState:
    """What the router knows about one decode node."""

    endpoint: DecodeEndpoint
    in_rotation: bool = False  # closed breaker: healthy and leasable
    leased: bool = False
    consecutive_failures: int = 0
    capabilities: dict[str, Any] | None = None
    transfer_id: str | None = None  # of the request holding the lease
    last_error: str = ""
    leases_total: int = 0
    step_s: float | None = None  # measured seconds per decoded token (EWMA), for the router's deadlines
    draining: bool = False  # healthy, finishing its request, leased no more (tilepd drain)
    held_since: float = 0.0  # the pool's clock when the current lease began
    held_alone: bool = False  # no other node has been leased since the current lease began
    unjudged_probes: int = 0  # health probes in a row that timed out while the router itself was held up (loop_lag.py)
    held_by: str | None = None  # another router holds the node's slot (its answer to our reservation); None: not known to
    _left_rotation: asyncio.Event | None = None

    @property
    def left_rotation(self) -> asyncio.Event:
        """Set while the node is out of rotation, so a request waiting on it can stop waiting at once."""
        if self._left_rotation is None:
            self._left_rotation = asyncio.Event()
            if not self.in_rotation:
                self._left_rotation.set()
        return self._left_rotation

    def note_step(self, seconds_per_token: float) -> None:
        """Fold one measured time per token into the node's speed (EWMA, weight 1/8)."""
        self.step_s = seconds_per_token if self.step_s is None else self.step_s + (seconds_per_token - self.step_s) / 8

    @property
    def name(self) -> str:
        return self.endpoint.name

    @property
    def base_url(self) -> str:
        return f"http://{self.endpoint.host}:{self.endpoint.http_port}"


class LeaseTimeout(Exception):
    """Every node stayed busy for the whole queue timeout."""


class NoNodeInRotation(Exception):
    """No decode node is healthy: waiting would not help."""


class Lease:
    """The right to use one node; `release()` is idempotent and hands the node to the next waiter."""

    def __init__(self, pool: NodePool, node: NodeState, waited_s: float) -> None:
        self._pool = pool
        self.node = node
        self.waited_s = waited_s
        self.released = False
        self.leased_at = pool.clock()
        self.reservation: Any = None  # the node's reservation (tilepd.router.reservations.Reservation), once it granted one

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._pool._release(self.node)
            if self._pool.on_release is not None:  # the node's service time, for `tilepd capacity`
                self._pool.on_release(self._pool.clock() - self.leased_at)

    def abandon(self, held_by: str | None) -> None:
        """End a lease that served nothing (the node refused the reservation), uncounted. `held_by`: another router
        holds the node's slot, and the node is leased no more until `NodePool.back_from_elsewhere`; None: the node
        goes back to the pool if it is still leasable."""
        if not self.released:
            self.released = True
            self._pool._abandon(self.node, held_by)


@dataclass
class NodePool:
    nodes: list[NodeState]
    _free: deque[NodeState] = field(default_factory=deque)
    _waiters: deque[asyncio.Future[NodeState]] = field(default_factory=deque)
    # called with the seconds a lease held its node (the node's service time, for `tilepd capacity`)
    on_release: Callable[[float], None] | None = None
    clock: Callable[[], float] = time.monotonic  # the lease and busy-level times (a test may step it by hand)
    # the pool as a birth-death chain: seconds spent with k nodes leased and the releases made from k. On a shared host
    # (CPU nodes, one prefill instance) a node's service time grows with the nodes busy next to it; releases / seconds
    # at k is the chain's completion rate there, which `tilepd capacity` fits (its maximum-likelihood estimate)
    _busy_since: float = 0.0  # when the leased count last changed (set from `clock` at creation)
    _busy_seconds: dict[int, float] = field(default_factory=dict)
    _releases_from: dict[int, int] = field(default_factory=dict)
    # holds of the leases that had the pool to themselves (no other node leased at any moment): a request's own length
    # at one fixed speed, whose spread `tilepd capacity` takes as the spread of the work (count, sum, sum of squares)
    _alone: tuple[int, float, float] = (0, 0.0, 0.0)
    # set whenever a node may have become leasable again (back in rotation, undrained): acquire_when_back waits on it
    _back: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._busy_since = self.clock()

    @classmethod
    def of(cls, endpoints: tuple[DecodeEndpoint, ...]) -> NodePool:
        return cls(nodes=[NodeState(endpoint=e) for e in endpoints])

    @property
    def queue_depth(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def leased_count(self) -> int:
        return sum(1 for n in self.nodes if n.leased)

    def busy_time(self) -> tuple[dict[int, float], dict[int, int]]:
        """({k: seconds with k nodes leased}, {k: releases made while k were leased}) since the pool began; the
        current stretch is counted up to now."""
        seconds = dict(self._busy_seconds)
        k = self.leased_count()
        seconds[k] = seconds.get(k, 0.0) + self.clock() - self._busy_since
        return seconds, dict(self._releases_from)

    def alone_holds(self) -> tuple[int, float, float]:
        """(leases, seconds, seconds squared) summed over the leases that ended having had the pool to themselves."""
        return self._alone

    def _set_leased(self, node: NodeState, leased: bool) -> None:
        """Every change of a node's lease goes through here, so the chain's time in each state is exact."""
        if node.leased == leased:
            return
        now = self.clock()
        k = self.leased_count()
        self._busy_seconds[k] = self._busy_seconds.get(k, 0.0) + now - self._busy_since
        self._busy_since = now
        if leased:
            node.held_since, node.held_alone = now, k == 0
            for other in self.nodes:
                if other.leased:
                    other.held_alone = False
        else:
            self._releases_from[k] = self._releases_from.get(k, 0) + 1
            if node.held_alone:
                n, total, squares = self._alone
                hold = now - node.held_since
                self._alone = (n + 1, total + hold, squares + hold * hold)
            node.held_alone = False
        node.leased = leased

    def in_rotation(self) -> list[NodeState]:
        """Nodes that can be leased: breaker closed and not draining."""
        return [n for n in self.nodes if n.in_rotation and not n.draining]

    async def acquire(self, timeout_s: float, *, first_in_line: bool = False) -> Lease:
        """Lease a free node, waiting FIFO for at most `timeout_s`; `first_in_line`: a waiter whose node turned out
        held by another router waits again at the head of the queue."""
        start = self.clock()
        node = self._take_free()
        if node is not None:
            return self._lease(node, start)
        if not self.in_rotation():
            raise NoNodeInRotation("no decode node is in rotation")
        fut: asyncio.Future[NodeState] = asyncio.get_running_loop().create_future()
        if first_in_line:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        try:
            async with asyncio.timeout(timeout_s):
                node = await fut
        except TimeoutError:
            # the node may have been handed over in the same instant the timer fired
            if fut.done() and not fut.cancelled():
                return self._lease(fut.result(), start)
            raise LeaseTimeout(f"all decode nodes stayed busy for {timeout_s:g}s") from None
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result())  # caller went away after the hand-over
            raise
        finally:
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass
        return self._lease(node, start)

    async def acquire_when_back(self, timeout_s: float) -> Lease:
        """`acquire` for a request that has nowhere else to go (mid-stream, no native pool) when no node is in
        rotation: wait up to `timeout_s` for one to come back (a node that was silent, not dead, answers its health
        checks again) and lease it, rather than fail a stream the client is already reading."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (remaining := deadline - loop.time()) > 0:
            if self.in_rotation():
                try:
                    return await self.acquire(remaining)
                except NoNodeInRotation:  # it left again before a node was free: wait for the next one
                    continue
            self._back.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._back.wait()
            except TimeoutError:
                break
        raise LeaseTimeout(f"no decode node came back into rotation within {timeout_s:g}s")

    def try_lease(self, node: NodeState) -> Lease | None:
        """Lease this very node now if it is free and no request waits for one, else None: background work (the
        divergence watch's probes) never holds a request up."""
        if self.queue_depth or node not in self._free or node.leased or not node.in_rotation or node.draining or node.held_by is not None:
            return None
        self._free.remove(node)
        return self._lease(node, self.clock())

    def _lease(self, node: NodeState, start: float) -> Lease:
        self._set_leased(node, True)  # already, when a release handed it over (_offer)
        node.leases_total += 1
        return Lease(self, node, self.clock() - start)

    def _take_free(self) -> NodeState | None:
        while self._free:
            node = self._free.popleft()
            if node.in_rotation and not node.leased and not node.draining and node.held_by is None:
                return node
        return None

    def _abandon(self, node: NodeState, held_by: str | None) -> None:
        """End a lease that served nothing: the chain's time moves on, but no release is counted."""
        now = self.clock()
        k = self.leased_count()
        self._busy_seconds[k] = self._busy_seconds.get(k, 0.0) + now - self._busy_since
        self._busy_since = now
        node.leased, node.held_alone, node.transfer_id = False, False, None
        node.leases_total -= 1
        node.held_by = held_by
        if held_by is None and node.in_rotation and not node.draining:
            self._offer(node)

    def back_from_elsewhere(self, node: NodeState) -> None:
        """The node says its slot is free: lease it again (to the oldest waiter, if any)."""
        if node.held_by is None:
            return
        node.held_by = None
        if node.in_rotation and not node.leased and not node.draining:
            self._offer(node)

    def _release(self, node: NodeState) -> None:
        self._set_leased(node, False)
        node.transfer_id = None
        if node.in_rotation and not node.draining and node.held_by is None:
            self._offer(node)

    def _offer(self, node: NodeState) -> None:
        """Give a free, healthy node to the oldest waiter, or park it."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                self._set_leased(node, True)
                fut.set_result(node)
                return
        if node not in self._free:
            self._free.append(node)

    def set_in_rotation(self, node: NodeState, healthy: bool) -> None:
        """Open or close the node's breaker; a node coming back serves waiters at once."""
        if healthy == node.in_rotation:
            return
        node.in_rotation = healthy
        if healthy:
            node.left_rotation.clear()
            self._back.set()
        else:
            node.left_rotation.set()
        if healthy and not node.leased and not node.draining and node.held_by is None:
            self._offer(node)
        if not healthy:
            self._withdraw(node)

    def set_draining(self, node: NodeState, draining: bool) -> bool:
        """Stop (or resume) leasing a node that is healthy; True when this changed anything."""
        if draining == node.draining:
            return False
        node.draining = draining
        if draining:
            self._withdraw(node)
        elif node.in_rotation and not node.leased and node.held_by is None:
            self._offer(node)
        if not draining:
            self._back.set()
        return True

    def _withdraw(self, node: NodeState) -> None:
        """The node takes no new lease: off the free list; with nothing left to serve, waiters fail over now."""
        try:
            self._free.remove(node)
        except ValueError:
            pass
        if not self.in_rotation():
            # nobody can serve the waiters: let them fail over now rather than time out
            while self._waiters:
                fut = self._waiters.popleft()
                if not fut.done():
                    fut.set_exception(NoNodeInRotation("no decode node is in rotation"))
