"""The decode node's single slot: who owns the receive buffer right now.

States (INTERFACES §4): free -> reserved -> transferring -> complete -> decoding
(-> cancelling) -> free. The node is the one judge of who holds its slot: a router
reserves it (`reserve`: its identity, a lease it renews, a fencing generation, the
`fence`) before the prefill, and both the connector's admit and the router's decode
request join that reservation, in either order, carrying its transfer id and token
(the decode request its fence too). A second reservation while the slot is held is
refused at once, `busy`, naming the holder. A reservation whose lease runs out (its
router died, was cut off, or got no CPU) lapses: the next reservation by any router takes
the slot back (a decode in progress is cancelled at its next step, that reservation told
`busy` until it has stopped; a decode request waiting for the KV fails), a late renewal or
decode request of its holder revives it, and with neither it is taken back after
LAPSE_GRACE_LEASES more leases. A router that merely stalled past its lease (a starved
host) so keeps a request nobody else wanted the node for.
Every admit gets a fresh generation number; the transport drops bytes of
any other generation, and `done` for another generation is ignored, so late,
duplicate and foreign writers cannot complete (or corrupt) someone else's slot.

The slot is pure bookkeeping under one condition variable; the transport is
armed/disarmed through the two callbacks so the receive side follows every
transition without this module knowing which transport runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from tilepd.auth import CANARY_TRANSFER_PREFIX
from tilepd.runbooks import see

log = logging.getLogger("tilepd.runtime.slot")


class State(str, Enum):
    FREE = "free"
    RESERVED = "reserved"
    TRANSFERRING = "transferring"
    COMPLETE = "complete"
    DECODING = "decoding"
    CANCELLING = "cancelling"


class SlotError(Exception):
    """A refused slot operation; `code` maps to a control reject or an HTTP status; `holder`: who holds the slot
    (a refused reservation tells the router that asked)."""

    def __init__(self, code: str, message: str, holder: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.holder = holder


@dataclass
class Reservation:
    """A router's hold on the slot: who, the fence its later calls must carry, and until when without a renewal."""

    holder: str
    fence: int
    lease_s: float
    deadline: float  # time.monotonic()
    expired: bool = False  # the lease ran out: the slot is being taken back
    lapsed: bool = False  # the lease ran out: the next reservation takes the slot back (module docstring)


@dataclass
class Transfer:
    """What the slot holds for the transfer that owns it."""

    transfer_id: str
    token: str
    http_joined: bool = False
    generation: int | None = None
    conn_id: int | None = None  # rank 0's control connection (kept for logs and single-rank callers)
    tp_size: int = 1  # prefill ranks that each send their share of the KV heads
    conn_ids: dict[int, int] = field(default_factory=dict)  # sender rank -> control connection
    done_ranks: set[int] = field(default_factory=set)
    seq_len: int = 0
    num_blocks: int = 0
    expected_bytes: int = 0
    layout: Any = None  # CacheLayout of the admitting connection
    admitted_at: float | None = None
    completed_at: float | None = None
    failure: str | None = None
    failure_code: str = "transfer_failed"  # the SlotError code a failed transfer raises (kv_checksum_mismatch, ...)
    cancel: threading.Event = field(default_factory=threading.Event)
    reservation: Reservation | None = None


@dataclass(frozen=True)
class Ended:
    """Why a transfer ended here; a failed one keeps its token, code and message, which its late decode request learns
    (instead of `cancelled`)."""

    reason: str
    failure: tuple[str, str, str] | None = None


ENDED_REMEMBERED = 4096  # transfer ids (~100 B each) kept to refuse late decode requests
DEFAULT_LEASE_S = 10.0  # DecodeServerConfig.reservation_lease_s
LAPSE_GRACE_LEASES = 2.0  # a lapsed reservation nobody claimed is taken back this many leases past its deadline


class Slot:
    def __init__(
        self,
        on_arm: Callable[[int, str, int], None] = lambda g, t, n: None,
        on_disarm: Callable[[], None] = lambda: None,
        orphan_timeout_s: float = 30.0,
        on_revoke: Callable[[int], None] = lambda conn_id: None,
        lease_s: float = DEFAULT_LEASE_S,
    ):
        self._cv = threading.Condition()
        self.state = State.FREE
        self.current: Transfer | None = None
        # generations start from the clock so a restarted node never reuses one
        self._next_generation = int(time.time() * 1000) << 4
        self._on_arm, self._on_disarm = on_arm, on_disarm
        # called with the control connection of a transfer taken away mid-transfer (timeout, cancel):
        # closing it makes the sender abort its write, so a one-sided writer stops early
        self._on_revoke = on_revoke
        self.orphan_timeout_s = orphan_timeout_s
        self.lease_s = lease_s  # a reservation's lease: it lives this long past its last renewal
        # called (under the slot's lock, so it must only schedule) whenever the slot becomes free: the HTTP side
        # answers the routers waiting for it (GET /v1/slot)
        self.on_free: Callable[[], None] = lambda: None
        self.reservations_expired = 0
        self.transfers_total = 0
        self.bytes_total = 0
        # set by the node's /admin/drain: the transfer holding the slot finishes, no new one may take the free slot
        # (except a restart's canary, whose transfer id starts with CANARY_TRANSFER_PREFIX)
        self.draining = False
        # transfers that ended here, newest last, bounded: a decode request that comes after its transfer was
        # cancelled or timed out (its handler stalled, the router gave up) must not take the free slot
        self._ended: OrderedDict[str, Ended] = OrderedDict()

    # -- views ----------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Held: a reservation would be refused (a lapsed one is taken by the next reservation)."""
        cur = self.current
        return self.state != State.FREE and not (cur is not None and cur.reservation is not None and cur.reservation.lapsed)

    def snapshot(self) -> dict[str, Any]:
        with self._cv:
            cur = self.current
            held = cur.reservation if cur is not None else None
            return {"state": self.state.value, "busy": self.busy, "transfer_id": cur.transfer_id if cur else None,
                    "decode_joined": bool(cur and cur.http_joined), "holder": held.holder if held else None, "fence": held.fence if held else None,
                    "lease_left_s": round(max(0.0, held.deadline - time.monotonic()), 3) if held else None,
                    "lapsed": bool(held and held.lapsed)}

    # -- the router's reservation ---------------------------------------------------------
    def reserve(self, transfer_id: str, token: str, holder: str = "-") -> Transfer:
        """Hold the free slot for `holder`'s transfer; refuse at once (`busy`, naming the holder) while it is held."""
        with self._cv:
            cur = self.current
            if cur is not None and cur.reservation is not None and cur.reservation.lapsed and not self.draining \
                    and transfer_id not in self._ended:  # (an id that ended here is refused below, taking nothing)
                self._take_back_locked(cur, cur.reservation, f"claimed by {holder}")
                cur = self.current
            if self.state != State.FREE:
                if self.draining:  # not `busy`: the router should not wait for this node, and should lease it no more
                    raise SlotError("draining", f"decode node is draining (finishing transfer {cur.transfer_id if cur else '?'}): it "
                                    "takes no new request")
                owner = cur.reservation.holder if cur is not None and cur.reservation is not None else "?"
                raise SlotError("busy", f"decode node busy: held by {owner} (transfer {cur.transfer_id if cur else '?'}, "
                                f"{self.state.value})", holder=owner)
            if self._drained_for(transfer_id):
                raise SlotError("draining", "decode node is draining: it takes no new request (undrain it or use another node)")
            ended = self._ended.get(transfer_id)
            if ended is not None:
                raise SlotError("duplicate" if ended.reason == "finished" else "cancelled",
                                f"transfer {transfer_id} already ended here ({ended.reason}): it cannot reserve the node again")
            fence = self._next_generation
            self._next_generation += 1
            held = Reservation(holder, fence, self.lease_s, time.monotonic() + self.lease_s)
            self.current = Transfer(transfer_id, token, reservation=held)
            self.state = State.RESERVED
            log.info("event=reserved transfer_id=%s holder=%s fence=%d lease_s=%g", transfer_id, holder, fence, self.lease_s)
            return self.current

    def renew(self, transfer_id: str, fence: int) -> float:
        """Extend the reservation's lease; the seconds it now has. A fence that holds the slot no more is refused."""
        with self._cv:
            held = self._held_by(transfer_id, fence)
            self._revive_locked(transfer_id, held, "renewal")
            held.deadline = time.monotonic() + held.lease_s
            return held.lease_s

    def expire_leases(self, held_up_s: float = 0.0) -> None:
        """Lapse or take back a reservation whose lease ran out (module docstring). `held_up_s`: how long the caller's
        clock tick was late (the node itself was held up): that time is added to the lease, since the holder's
        renewals may be waiting unread."""
        with self._cv:
            cur = self.current
            held = cur.reservation if cur is not None else None
            if cur is None or held is None or held.expired:
                return
            if held_up_s > 0:
                held.deadline += held_up_s
            now = time.monotonic()
            if now < held.deadline:
                return
            if self.state != State.CANCELLING:
                grace_s = LAPSE_GRACE_LEASES * held.lease_s
                if not held.lapsed:
                    held.lapsed = True
                    log.warning("event=reservation_lapsed transfer_id=%s holder=%s fence=%d state=%s lease_s=%g grace_s=%g "
                                "(the next reservation takes the slot; a renewal revives it)", cur.transfer_id, held.holder,
                                held.fence, self.state.value, held.lease_s, grace_s)
                    self._cv.notify_all()
                    self.on_free()  # routers waiting for the slot may take it now
                if now < held.deadline + grace_s:
                    return
            self._take_back_locked(cur, held, "not renewed")

    def _take_back_locked(self, cur: Transfer, held: Reservation, why: str) -> None:
        """End a reservation whose lease ran out, cancelling or failing its decode."""
        held.expired, held.lapsed = True, False
        self.reservations_expired += 1
        log.warning("event=reservation_expired transfer_id=%s holder=%s fence=%d state=%s lease_s=%g why=%r", cur.transfer_id,
                    held.holder, held.fence, self.state.value, held.lease_s, why)
        if self.state == State.DECODING:  # the engine stops at its next step; the decode's release frees the slot
            cur.cancel.set()
            self.state = State.CANCELLING
        elif self.state != State.CANCELLING:
            if cur.http_joined:  # its decode request waits for the KV: it fails with the reason
                self._fail_locked(f"the reservation of {held.holder} expired (not renewed for {held.lease_s:g} s)",
                                  "reservation_lost")
            else:
                self._free_locked("lease_expired")
        self._cv.notify_all()

    def _revive_locked(self, transfer_id: str, held: Reservation, by: str) -> None:
        if held.lapsed:
            held.lapsed = False
            log.warning("event=reservation_revived transfer_id=%s holder=%s fence=%d by=%s late_s=%.2f", transfer_id, held.holder,
                        held.fence, by, time.monotonic() - held.deadline)

    # -- HTTP side ------------------------------------------------------------------
    def attach_decode(self, transfer_id: str, token: str, fence: int) -> Transfer:
        """The router's decode request joins its reservation (before or after the connector's admit)."""
        with self._cv:
            cur = self.current
            if cur is None or cur.transfer_id != transfer_id:
                ended = self._ended.get(transfer_id)
                if ended is not None and ended.failure is not None and ended.failure[0] == token:  # its KV failed before
                    _, code, message = ended.failure  # the router's decode request came
                    raise SlotError(code, f"transfer {transfer_id} failed here before its decode request came: {message}")
                if ended is not None:
                    code = "duplicate" if ended.reason == "finished" else "reservation_lost" if ended.reason == "lease_expired" else "cancelled"
                    raise SlotError(code, f"transfer {transfer_id} already ended here ({ended.reason}): a late decode request cannot take the node")
                if cur is None:
                    raise SlotError("not_reserved", f"no reservation for transfer {transfer_id} on this node: a router reserves the "
                                    "slot (POST /v1/reserve) before the prefill")
                if self.draining:
                    raise SlotError("draining", f"decode node is draining (finishing transfer {cur.transfer_id}): it takes no new request")
                owner = cur.reservation.holder if cur.reservation is not None else "?"
                raise SlotError("busy", f"decode node busy: held by {owner} (transfer {cur.transfer_id}, {self.state.value})", holder=owner)
            held = self._held_by(transfer_id, fence)
            if cur.token != token:
                raise SlotError("bad_token", f"token does not match the one transfer {transfer_id} was reserved with")
            if cur.http_joined:
                raise SlotError("duplicate", f"transfer {transfer_id} already has a decode request")
            if held.lapsed:  # its router is back: the lease runs again from now
                self._revive_locked(transfer_id, held, "decode_request")
                held.deadline = time.monotonic() + held.lease_s
            cur.http_joined = True
            log.info("event=joined transfer_id=%s state=%s", transfer_id, self.state.value)
            return cur

    def wait_complete(self, transfer: Transfer, timeout: float) -> None:
        """Block until `transfer`'s KV has landed; on timeout, failure or cancel, free the slot and raise."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                if self.current is not transfer:
                    raise SlotError(transfer.failure and transfer.failure_code or "cancelled",
                                    transfer.failure or f"transfer {transfer.transfer_id} was cancelled")
                if transfer.cancel.is_set():
                    self._free_locked("cancelled")
                    raise SlotError("cancelled", f"transfer {transfer.transfer_id} was cancelled")
                if self.state == State.COMPLETE:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    was = "transferring" if transfer.generation else "reserved"
                    log.warning("event=transfer_failed transfer_id=%s generation=%s code=kv_timeout runbook=RB-kv-timeout "
                                "reason=no KV within %g s (state was %s)", transfer.transfer_id, transfer.generation, timeout, was)
                    self._free_locked("kv_timeout")
                    raise SlotError("kv_timeout", f"KV for transfer {transfer.transfer_id} did not arrive within {timeout:g} s "
                                    f"(state was {was}); slot freed" + see("RB-kv-timeout"))
                self._cv.wait(min(left, 0.5))

    def start_decoding(self, transfer: Transfer) -> None:
        with self._cv:
            if self.current is not transfer or self.state != State.COMPLETE:
                raise SlotError("cancelled", f"transfer {transfer.transfer_id} no longer owns the slot")
            self.state = State.DECODING
            log.info("event=decoding transfer_id=%s", transfer.transfer_id)

    def release(self, transfer: Transfer, reason: str = "finished") -> None:
        with self._cv:
            if self.current is transfer:
                self._free_locked(reason)

    def cancel(self, transfer_id: str, fence: int | None = None) -> bool:
        """Stop the transfer/decode with this id (and `fence`, when given); a decode stops at its next step. An id that
        does not hold the slot is remembered as cancelled, so its KV, should it come later, cannot take the free slot."""
        with self._cv:
            cur = self.current
            if cur is None or cur.transfer_id != transfer_id:
                if transfer_id not in self._ended:
                    self._remember_ended(transfer_id, "cancelled")
                return False
            if fence is not None and (cur.reservation is None or cur.reservation.fence != fence):
                return False
            cur.cancel.set()
            if self.state == State.DECODING:
                self.state = State.CANCELLING
                log.info("event=cancelling transfer_id=%s", transfer_id)
            elif not cur.http_joined:
                self._free_locked("cancelled")
            self._cv.notify_all()
            return True

    # -- control side -----------------------------------------------------------------
    def admit(self, transfer_id: str, token: str, seq_len: int, num_blocks: int, expected_bytes: int,
              layout: Any, conn_id: int, arm_limit: int | None = None, *, sender_rank: int = 0, tp_size: int = 1) -> int:
        """Grant a generation for this transfer (arms the transport), or raise SlotError.

        With tp_size > 1 every prefill rank admits the same transfer id; the first admit draws the
        generation and arms the receiver, the other ranks join it. `expected_bytes` counts all ranks.
        A rank that admits twice (it reconnected) starts a new generation for the whole transfer.
        """
        with self._cv:
            cur = self.current
            if self.state == State.FREE:
                if self._drained_for(transfer_id):  # `busy`: the control protocol's retryable refusal
                    raise SlotError("busy", "decode node is draining: it takes no new transfer")
                ended = self._ended.get(transfer_id)
                if ended is not None:  # its decode request gave up, it was cancelled, or its router's lease ran out
                    raise SlotError("unknown_transfer", f"transfer {transfer_id} already ended here ({ended.reason}): its KV is not taken")
                raise SlotError("unknown_transfer", f"no reservation for transfer {transfer_id} on decode node: the router reserves "
                                "the node before the prefill (node API 2); a router of an older tilepd does not: upgrade it")
            if cur is not None and cur.transfer_id == transfer_id:
                if cur.token != token:
                    raise SlotError("bad_token", f"token does not match the decode request for transfer {transfer_id}")
                if self.state not in (State.RESERVED, State.TRANSFERRING):
                    raise SlotError("unknown_transfer", f"transfer {transfer_id} is already {self.state.value}; duplicate admit ignored")
                if self.state == State.TRANSFERRING and (tp_size != cur.tp_size or seq_len != cur.seq_len):
                    raise SlotError("layout_mismatch", f"rank {sender_rank} admits transfer {transfer_id} with tp_size {tp_size} "
                                    f"and seq_len {seq_len}; rank(s) {sorted(cur.conn_ids)} admitted {cur.tp_size} and {cur.seq_len}")
            else:
                raise SlotError("busy", f"decode node {'is draining, ' if self.draining else ''}busy with transfer "
                                f"{cur.transfer_id if cur else '?'} ({self.state.value})")
            if self.state == State.TRANSFERRING and sender_rank not in cur.conn_ids:
                cur.conn_ids[sender_rank] = conn_id  # another rank of the same transfer joins its generation
                if sender_rank == 0:
                    cur.conn_id = conn_id
                log.info("event=admitted transfer_id=%s generation=%d rank=%d/%d", transfer_id, cur.generation, sender_rank, tp_size)
                return cur.generation  # type: ignore[return-value]
            gen = self._next_generation
            self._next_generation += 1
            if self.state == State.TRANSFERRING:
                log.info("event=readmit transfer_id=%s old_generation=%s generation=%d rank=%d", transfer_id, cur.generation, gen, sender_rank)
            cur.generation, cur.tp_size = gen, tp_size
            cur.conn_ids, cur.done_ranks = {sender_rank: conn_id}, set()
            cur.conn_id = conn_id if sender_rank == 0 else None
            cur.seq_len, cur.num_blocks, cur.expected_bytes, cur.layout = seq_len, num_blocks, expected_bytes, layout
            cur.admitted_at = time.monotonic()
            self.state = State.TRANSFERRING
            self._on_arm(gen, transfer_id, expected_bytes if arm_limit is None else arm_limit)
            log.info("event=admitted transfer_id=%s generation=%d rank=%d/%d seq_len=%d bytes=%d", transfer_id, gen, sender_rank,
                     tp_size, seq_len, expected_bytes)
            self._cv.notify_all()
            return gen

    def complete(self, transfer_id: str, generation: int, ok: bool, error: str | None = None, *,
                 sender_rank: int = 0, conn_id: int | None = None, code: str = "transfer_failed") -> tuple[bool, str]:
        """A sender rank's `done`; returns (accepted, message). Stale generations are ignored.

        The transfer is complete once every rank that the first admit announced has said done. With
        `conn_id`, only the control connection that admitted this rank may say done (or fail it).
        """
        with self._cv:
            cur = self.current
            if cur is None or cur.transfer_id != transfer_id or cur.generation != generation or self.state != State.TRANSFERRING \
                    or sender_rank not in cur.conn_ids or (conn_id is not None and cur.conn_ids[sender_rank] != conn_id):
                log.info("event=done_ignored transfer_id=%s generation=%d rank=%d reason=stale_or_unknown", transfer_id, generation,
                         sender_rank)
                return False, f"transfer {transfer_id} generation {generation} does not own the slot"
            if not ok:
                # the connection saying done gets its ack (with the reason); other ranks' connections are revoked
                self._fail_locked(f"sender rank {sender_rank} reported a failed transfer: {error or 'no reason given'}"
                                  if code == "transfer_failed" else (error or code), code, keep_conn=conn_id)
                return False, "failure recorded"
            cur.done_ranks.add(sender_rank)
            if len(cur.done_ranks) < cur.tp_size:
                log.info("event=rank_done transfer_id=%s generation=%d rank=%d done=%d/%d", transfer_id, generation, sender_rank,
                         len(cur.done_ranks), cur.tp_size)
                return True, ""
            self.state = State.COMPLETE
            cur.completed_at = time.monotonic()
            self.transfers_total += 1
            self.bytes_total += cur.expected_bytes
            self._on_disarm()
            log.info("event=complete transfer_id=%s generation=%d bytes=%d", transfer_id, generation, cur.expected_bytes)
            self._cv.notify_all()
            return True, ""

    def sender_gone(self, conn_id: int) -> None:
        """The control connection that was granted the current transfer closed before done."""
        with self._cv:
            cur = self.current
            if cur is None or self.state != State.TRANSFERRING:
                return
            ranks = [r for r, c in cur.conn_ids.items() if c == conn_id and r not in cur.done_ranks]
            if ranks:  # the prefill (its connector) restarted or died: the decode request fails with this message
                self._fail_locked(f"the sender's control connection (rank {ranks[0]}) closed mid-transfer" + see("RB-prefill-restarted"),
                                  runbook="RB-prefill-restarted")

    def reap_orphans(self) -> None:
        """Free a slot whose KV came (admitted) but no decode request joined in time. Before the admit the reservation's
        lease is what bounds it: the prefill may queue for long in vLLM while its router lives."""
        with self._cv:
            cur = self.current
            if cur is None or cur.http_joined or cur.admitted_at is None or self.state not in (State.TRANSFERRING, State.COMPLETE):
                return
            if time.monotonic() - cur.admitted_at > self.orphan_timeout_s:
                self._free_locked("orphaned: no decode request joined")

    # -- internals ----------------------------------------------------------------------
    def _fail_locked(self, reason: str, code: str = "transfer_failed", keep_conn: int | None = None, runbook: str | None = None) -> None:
        cur = self.current
        assert cur is not None
        cur.failure, cur.failure_code = reason, code
        book = f" runbook={runbook}" if runbook else ""
        log.warning("event=transfer_failed transfer_id=%s generation=%s code=%s%s reason=%s", cur.transfer_id, cur.generation, code, book, reason)
        self._free_locked("transfer_failed", keep_conn, failure=(cur.token, code, reason))

    def _held_by(self, transfer_id: str, fence: int) -> Reservation:
        """The current reservation when it is this transfer's under this fence; else `reservation_lost` saying why."""
        cur = self.current
        held = cur.reservation if cur is not None else None
        if cur is not None and held is not None and cur.transfer_id == transfer_id and held.fence == fence and not held.expired:
            return held
        ended = self._ended.get(transfer_id)
        why = f"it ended here ({ended.reason})" if ended else "the slot is held by another" if cur is not None else "the slot is free"
        raise SlotError("reservation_lost", f"transfer {transfer_id} with fence {fence} holds this node's slot no more: {why}")

    def _free_locked(self, reason: str, keep_conn: int | None = None, failure: tuple[str, str, str] | None = None) -> None:
        cur = self.current
        if cur is not None and cur.reservation is not None and cur.reservation.expired:
            reason = "lease_expired"  # however the decode ended, its router's lease is why (a late decode request learns it)
            failure = None  # that is `reservation_lost` to it, not the transfer's failure
        self._on_disarm()
        if cur is not None and self.state == State.TRANSFERRING:
            for conn in set(cur.conn_ids.values()) - {keep_conn}:
                self._on_revoke(conn)
        self.current = None
        self.state = State.FREE
        if cur is not None:
            self._remember_ended(cur.transfer_id, reason, failure)
        log.info("event=freed transfer_id=%s reason=%s", cur.transfer_id if cur else None, reason)
        self._cv.notify_all()
        self.on_free()

    def _drained_for(self, transfer_id: str) -> bool:
        """Draining refuses a new transfer on the free slot, except a restart's canary."""
        return self.draining and not transfer_id.startswith(CANARY_TRANSFER_PREFIX)

    def _remember_ended(self, transfer_id: str, reason: str, failure: tuple[str, str, str] | None = None) -> None:
        self._ended[transfer_id] = Ended(reason, failure)
        self._ended.move_to_end(transfer_id)
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
