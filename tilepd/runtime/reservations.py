"""The node's side of a router's reservation (INTERFACES §4, node API 2): reserve, renew, the slot-free wait, the lease clock.

Several routers may lease the same nodes, sharing nothing; the node is the one judge of who holds its slot. A router
reserves it before the prefill (`POST /v1/reserve`: transfer id, token, its identity) and gets the reservation's
fence and lease; a reservation while the slot is held is refused at once, 429 `busy` with the holder's identity,
and that router tries another node or waits. It waits on `GET /v1/slot?wait_s=N`, which the node answers the moment
its slot is free (or draining), or after N seconds: a router whose every node is busy holds one such wait per node
and polls nothing.

The holder renews (`POST /v1/renew`) while its request lives. A lease not renewed for `reservation_lease_s` (its
router died, or lost the network) lapses: the next reservation takes the slot back, cancelling the orphaned decode,
while a late renewal revives it (runtime.slot); a lapsed slot counts as free to `GET /v1/slot`. The lease is
timed on the node's event loop, which also answers the renewals: when that loop was held up (no CPU, a stall), the
time it lost is added to the lease, since renewals may be waiting unread in its sockets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi.responses import JSONResponse

from tilepd.auth import transfer_token_ok
from tilepd.contracts.decode_http import NODE_API_VERSION, RenewBody, ReserveBody
from tilepd.runtime.decode_call import SLOT_STATUS, older_router
from tilepd.runtime.http_errors import error_response, unauthorized
from tilepd.runtime.service import DecodeService
from tilepd.runtime.slot import SlotError

log = logging.getLogger("tilepd.runtime.http")

LEASE_TICK_S = 0.25  # how often the lease clock looks; a tick this much later than due (and more) counts as held up
HELD_UP_AFTER_S = 0.5
MAX_SLOT_WAIT_S = 30.0  # the longest a `GET /v1/slot` waits (a router asks again)


class SlotFreeSignal:
    """Wakes every `GET /v1/slot` waiting on the event loop when the slot becomes free (the slot calls `fire` from any
    thread, under its lock: it only schedules)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()

    def fire(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        event = self._event
        if event is None:
            return
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass


async def run_lease_clock(svc: DecodeService) -> None:
    """Expire reservations whose lease ran out; time this loop itself lost is added to the leases (module docstring)."""
    loop = asyncio.get_running_loop()
    last = loop.time()
    while True:
        await asyncio.sleep(LEASE_TICK_S)
        now = loop.time()
        late = now - last - LEASE_TICK_S
        last = now
        held_up = late if late > HELD_UP_AFTER_S else 0.0
        if held_up:
            log.warning("event=lease_clock_held_up node=%s late_s=%.2f (added to the lease held)", svc.config.name, held_up)
        svc.slot.expire_leases(held_up)


def reserve(svc: DecodeService, body: ReserveBody, secret: bytes | None) -> JSONResponse | dict[str, Any]:
    tid = body.transfer_id
    if secret is not None and not transfer_token_ok(secret, tid, body.token):
        log.warning("event=reserve_refused transfer_id=%s code=invalid_transfer_token", tid)
        return unauthorized(f"token of transfer {tid} was not minted with this deployment's secret", "invalid_transfer_token")
    if body.node_api != NODE_API_VERSION:
        log.warning("event=reserve_refused transfer_id=%s code=node_api_mismatch holder=%s node_api=%d", tid, body.holder, body.node_api)
        if body.node_api > NODE_API_VERSION:
            return error_response(426, "node_api_mismatch", f"{body.holder} speaks node API {body.node_api}, this decode node "
                                  f"{NODE_API_VERSION}: upgrade the decode nodes")
        return older_router(f"{body.holder} speaks node API {body.node_api}")
    if not svc.ready:
        return error_response(503, "not_ready", "decode node is starting")
    try:
        transfer = svc.slot.reserve(tid, body.token, body.holder)
    except SlotError as exc:
        log.info("event=reserve_refused transfer_id=%s code=%s holder=%s by=%s", tid, exc.code, body.holder, exc.holder or "-")
        return error_response(SLOT_STATUS.get(exc.code, 409), exc.code, exc.message,
                              extra={"holder": exc.holder} if exc.holder else None)
    held = transfer.reservation
    assert held is not None
    return {"transfer_id": tid, "fence": held.fence, "lease_s": held.lease_s, "holder": held.holder, "node": svc.config.name,
            "node_api": NODE_API_VERSION}


def renew(svc: DecodeService, body: RenewBody) -> JSONResponse | dict[str, Any]:
    try:
        lease_s = svc.slot.renew(body.transfer_id, body.fence)
    except SlotError as exc:
        log.info("event=renew_refused transfer_id=%s fence=%d code=%s", body.transfer_id, body.fence, exc.code)
        return error_response(SLOT_STATUS.get(exc.code, 409), exc.code, exc.message)
    return {"transfer_id": body.transfer_id, "fence": body.fence, "lease_s": lease_s}


async def slot_view(svc: DecodeService, signal: SlotFreeSignal, wait_s: float) -> dict[str, Any]:
    """The slot, once it is free (or lapsed) or draining, or after `wait_s` (at most MAX_SLOT_WAIT_S) as it is then."""
    deadline = time.monotonic() + min(max(wait_s, 0.0), MAX_SLOT_WAIT_S)
    while True:
        snap = svc.slot.snapshot()
        left = deadline - time.monotonic()
        if not snap["busy"] or svc.slot.draining or left <= 0:
            return {**snap, "draining": svc.slot.draining}
        await signal.wait(left)
