"""A request's decode node, reserved on the node itself (node API 2, INTERFACES §4).

Several routers may serve the same decode nodes and share nothing: each node judges who holds its one slot. A
request first takes a node from this router's pool (leases.py: its own FIFO), then reserves the node's slot before
the prefill (`POST /v1/reserve`, with the transfer id and token the request will use and this router's identity).
The node answers a fence and a lease, renewed here every quarter of the lease while the request holds it; a
renewal the node refuses (the lease ran out while this router was cut off) trips the request's watchdog and the
request goes on elsewhere.

A node that answers `busy` is held by another router (it names which): the lease here ends uncounted, the node is
marked `held_by` that router, and the request waits again at the head of this router's queue. For each such node the
router holds one `GET /v1/slot?wait_s=` that the node answers the moment its slot is free; the node then goes back
to this router's free list and its oldest waiter. So no router polls: every router waiting on a node hears the free
slot at the same moment, and the first reservation to reach the node wins. Within a router the order is FIFO;
across routers it is that race, each router keeping its own queue's order, and the load balancer in front
(least connections) keeps the routers' queues about as long as each other's.

A node that refuses for any other reason (draining, not ready, unreachable, a node API other than this router's)
leaves this router's rotation or is marked draining, as its answer says, and the request tries the next node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field

from tilepd.auth import transfer_token
from tilepd.contracts.decode_http import NODE_API_VERSION, RenewBody, ReserveBody
from tilepd.contracts.service_configs import RouterConfig
from tilepd.router.backends import cancel_decode
from tilepd.router.health import note_draining
from tilepd.router.leases import Lease, LeaseTimeout, NodeState
from tilepd.router.state import RouterState
from tilepd.router.upstream import UpstreamError

log = logging.getLogger("tilepd.router")

RESERVE_TIMEOUT_S = 5.0  # one /v1/reserve (a node that takes longer is as good as down for this request)
SLOT_WAIT_S = 10.0  # one GET /v1/slot long-poll; asked again while the node stays held by another router
SLOT_WAIT_RETRY_S = 0.5  # after a failed long-poll
MIN_RENEW_S = 0.25
RESERVATION_LOST = "reservation_lost"  # the watchdog's trip reason when the node took the slot back


def router_identity(config: RouterConfig) -> str:
    """Who holds a node's slot, as another router (and the node's log) is told: name, host:port, pid."""
    return f"{config.name} ({socket.gethostname()}:{config.port}, pid {os.getpid()})"


@dataclass
class Reservation:
    """The node's grant: the request's transfer id and token, the fence its later calls carry, the lease."""

    transfer_id: str
    token: str
    fence: int
    lease_s: float
    lost: str | None = None  # why the node took the slot back (a refused renewal), once it did
    renewer: asyncio.Task[None] | None = field(default=None, repr=False)


async def lease_node(state: RouterState, timeout_s: float, *, when_back: bool = False) -> Lease:
    """A node leased in this router's pool and reserved on the node, within `timeout_s` (LeaseTimeout,
    NoNodeInRotation as `NodePool.acquire`); `when_back`: wait for a node to come back into rotation
    (`NodePool.acquire_when_back`)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout_s
    again = False
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise LeaseTimeout(f"all decode nodes stayed busy for {timeout_s:g}s")
        if when_back:
            lease = await state.pool.acquire_when_back(remaining)
        else:
            lease = await state.pool.acquire(remaining, first_in_line=again)
        if await _reserve(state, lease):
            lease.waited_s = loop.time() - start
            return lease
        again = True


async def try_lease_node(state: RouterState, node: NodeState) -> Lease | None:
    """This very node leased and reserved now, else None: it is busy here, a request waits, or the node refused the
    reservation (another router holds it: marked `held_by` and watched until free, as for a request). For background
    work (the divergence watch's probes) that must neither hold a request up nor take a node another router holds."""
    lease = state.pool.try_lease(node)
    if lease is None or not await _reserve(state, lease):
        return None
    return lease


async def _reserve(state: RouterState, lease: Lease) -> bool:
    """Reserve the leased node's slot: True with `lease.reservation` set; False when the node refused (the lease is
    ended and the node marked as its answer says)."""
    node = lease.node
    tid = f"tx-{uuid.uuid4().hex}"
    # with a deployment secret the token is HMAC(secret, transfer id): the node checks it without state
    token = transfer_token(state.node_secret, tid) if state.node_secret else secrets.token_hex(16)
    body = ReserveBody(transfer_id=tid, token=token, holder=state.identity, node_api=NODE_API_VERSION).as_json()
    try:
        resp = await state.client.request("POST", f"{node.base_url}/v1/reserve", body=body, headers=state.node_headers,
                                          timeout_s=RESERVE_TIMEOUT_S)
    except UpstreamError as exc:
        state.metrics.node_down(state.pool, node, f"reserve: {exc}")
        lease.abandon(None)
        return False
    except BaseException:  # the request went away mid-call: the node may have granted it; end it there
        state.spawn(cancel_decode(state.client, node.base_url, tid, headers=state.node_headers))
        lease.abandon(None)
        raise
    if resp.status == 200:
        try:
            grant = resp.json()
            res = Reservation(tid, token, int(grant["fence"]), float(grant["lease_s"]))
        except (ValueError, KeyError, TypeError) as exc:
            state.metrics.node_down(state.pool, node, f"reserve answered without a fence: {exc}")
            lease.abandon(None)
            return False
        lease.reservation = res
        node.transfer_id = tid
        res.renewer = asyncio.get_running_loop().create_task(_renew_while_held(state, lease, res))
        return True
    try:
        err = resp.json().get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    code, message = str(err.get("code") or resp.status), str(err.get("message") or "")[:300]
    state.metrics.reservation_refusals.labels(node.name, code).inc()
    if code == "busy":
        holder = str(err.get("holder") or "another router")
        lease.abandon(holder)
        log.info("event=node_held_elsewhere node=%s holder=%r", node.name, holder)
        watch_until_free(state, node)
        return False
    if code == "draining":
        note_draining(state, node, True, "reserve answered draining")
    else:  # not ready, another node API, a bad key: out of rotation until its health checks pass again
        state.metrics.node_down(state.pool, node, f"reserve answered {resp.status} {code}: {message}")
    lease.abandon(None)
    return False


async def _renew_while_held(state: RouterState, lease: Lease, res: Reservation) -> None:
    node = lease.node
    every = max(MIN_RENEW_S, res.lease_s / 4)
    body = RenewBody(transfer_id=res.transfer_id, fence=res.fence).as_json()
    while not lease.released:
        await asyncio.sleep(every)
        if lease.released:
            return
        try:
            resp = await state.client.request("POST", f"{node.base_url}/v1/renew", body=body, headers=state.node_headers,
                                              timeout_s=every)
        except UpstreamError:
            continue  # the node's own liveness is the watchdog's to judge; the next renewal may get through
        if resp.status == 410 and not lease.released:
            try:
                why = str(resp.json()["error"]["message"])[:300]
            except (ValueError, KeyError, TypeError):
                why = "renewal refused"
            res.lost = why
            log.warning("event=reservation_lost node=%s transfer=%s fence=%d why=%r", node.name, res.transfer_id, res.fence, why)
            return


def end_renewal(lease: Lease) -> None:
    """Stop renewing (the lease is being returned)."""
    res = lease.reservation
    if res is not None and res.renewer is not None:
        res.renewer.cancel()


def watch_until_free(state: RouterState, node: NodeState) -> None:
    """One long-poll per node held by another router, until the node says its slot is free (module docstring)."""
    task = state.slot_watches.get(node.name)
    if task is None or task.done():
        state.slot_watches[node.name] = asyncio.get_running_loop().create_task(_watch(state, node))


async def _watch(state: RouterState, node: NodeState) -> None:
    t0 = time.monotonic()
    while node.held_by is not None:
        if not node.in_rotation:  # its health checks bring it back; the next reservation learns who holds it then
            node.held_by = None
            return
        try:
            resp = await state.client.request("GET", f"{node.base_url}/v1/slot?wait_s={SLOT_WAIT_S:g}", timeout_s=SLOT_WAIT_S + 5.0)
            view = resp.json() if resp.status == 200 else None
        except (UpstreamError, ValueError):
            view = None
        if not isinstance(view, dict):
            await asyncio.sleep(SLOT_WAIT_RETRY_S)
            continue
        if view.get("draining"):
            node.held_by = None
            note_draining(state, node, True, "the node's slot view says draining")
            return
        if not view.get("busy"):
            log.info("event=node_free_again node=%s held_s=%.2f", node.name, time.monotonic() - t0)
            state.pool.back_from_elsewhere(node)
            return
        if view.get("holder"):
            node.held_by = str(view["holder"])
