"""The slot state machine: unit tests of every transition the server relies on."""

from __future__ import annotations

import threading
import time

import pytest

from tests.reserved import reserve_and_attach
from tilepd.runtime.slot import LAPSE_GRACE_LEASES, Slot, SlotError, State


def _slot(**kw) -> tuple[Slot, list]:
    events: list = []
    s = Slot(on_arm=lambda g, t, n: events.append(("arm", g, t, n)), on_disarm=lambda: events.append(("disarm",)), **kw)
    return s, events


def test_decode_first_then_admit_then_done() -> None:
    s, ev = _slot()
    tr = reserve_and_attach(s, "t1", "k")
    assert s.state == State.RESERVED
    g = s.admit("t1", "k", 10, 1, 100, None, conn_id=1)
    assert s.state == State.TRANSFERRING and ev[-1] == ("arm", g, "t1", 100)
    assert s.complete("t1", g, True) == (True, "")
    s.wait_complete(tr, 1)
    s.start_decoding(tr)
    assert s.state == State.DECODING
    s.release(tr)
    assert s.state == State.FREE and s.transfers_total == 1 and s.bytes_total == 100


def test_admit_first_then_decode_joins() -> None:
    s, _ = _slot()
    fence = s.reserve("t1", "k", "router-a").reservation.fence
    g = s.admit("t1", "k", 10, 1, 100, None, conn_id=1)
    s.complete("t1", g, True)
    tr = s.attach_decode("t1", "k", fence)
    s.wait_complete(tr, 0.1)
    with pytest.raises(SlotError) as e:
        s.attach_decode("t1", "k", fence)
    assert e.value.code == "duplicate"


def test_busy_names_the_holder_and_bad_token() -> None:
    s, _ = _slot()
    s.reserve("t1", "k", "router-a (host:8000, pid 1)")
    for call in (lambda: s.admit("t2", "k", 1, 1, 1, None, 1), lambda: s.reserve("t2", "k", "router-b"),
                 lambda: s.attach_decode("t2", "k", 1)):
        with pytest.raises(SlotError) as e:
            call()
        assert e.value.code == "busy"
    with pytest.raises(SlotError) as e:
        s.reserve("t2", "k", "router-b")
    assert e.value.holder == "router-a (host:8000, pid 1)" and "held by router-a" in e.value.message
    with pytest.raises(SlotError) as e:
        s.admit("t1", "wrong", 1, 1, 1, None, 1)
    assert e.value.code == "bad_token"


def test_nothing_takes_a_free_slot_without_a_reservation() -> None:
    """An admit or a decode request on a free slot comes from a router of node API 1 (it reserves nothing) or from a
    reservation that ended: neither may take the slot."""
    s, _ = _slot()
    with pytest.raises(SlotError) as e:
        s.admit("t1", "k", 10, 1, 100, None, conn_id=1)
    assert e.value.code == "unknown_transfer" and "no reservation" in e.value.message
    with pytest.raises(SlotError) as e:
        s.attach_decode("t1", "k", 0)
    assert e.value.code == "not_reserved"
    assert s.state == State.FREE


def test_the_fence_guards_renew_decode_and_cancel() -> None:
    s, _ = _slot()
    fence = s.reserve("t1", "k", "a").reservation.fence
    for call in (lambda: s.renew("t1", fence + 1), lambda: s.attach_decode("t1", "k", fence + 1)):
        with pytest.raises(SlotError) as e:
            call()
        assert e.value.code == "reservation_lost"
    assert not s.cancel("t1", fence + 1) and s.state == State.RESERVED
    assert s.renew("t1", fence) == s.lease_s
    assert s.cancel("t1", fence) and s.state == State.FREE  # a reservation no decode joined: freed at once
    with pytest.raises(SlotError) as e:
        s.renew("t1", fence)
    assert e.value.code == "reservation_lost" and "ended here (cancelled)" in e.value.message
    assert s.reserve("t2", "k", "b").reservation.fence > fence  # fences only grow


def test_an_unrenewed_reservation_lapses_then_is_taken_back_after_the_grace() -> None:
    s, _ = _slot(lease_s=0.05)
    freed: list[int] = []
    s.on_free = lambda: freed.append(1)
    fence = s.reserve("t1", "k", "dead-router").reservation.fence
    s.expire_leases()
    assert s.state == State.RESERVED and s.busy  # within its lease
    time.sleep(0.06)
    s.expire_leases()  # lapsed: routers waiting for the slot hear of it; nobody took it yet
    assert s.state == State.RESERVED and not s.busy and s.snapshot()["lapsed"] and freed == [1]
    assert s.reservations_expired == 0
    time.sleep(LAPSE_GRACE_LEASES * 0.05 + 0.01)
    s.expire_leases()
    assert s.state == State.FREE and freed == [1, 1] and s.reservations_expired == 1
    with pytest.raises(SlotError) as e:  # the KV of the dead router's prefill, arriving late
        s.admit("t1", "k", 10, 1, 100, None, conn_id=1)
    assert e.value.code == "unknown_transfer" and "lease_expired" in e.value.message
    with pytest.raises(SlotError) as e:
        s.attach_decode("t1", "k", fence)
    assert e.value.code == "reservation_lost"


def test_a_lapsed_reservation_goes_to_the_next_router_or_back_to_its_own() -> None:
    s, _ = _slot(lease_s=0.05)
    fence = s.reserve("t1", "k", "stalled-router").reservation.fence
    s.complete("t1", s.admit("t1", "k", 1, 1, 1, None, 1), True)  # its KV is here, its decode request not yet
    time.sleep(0.06)
    s.expire_leases()
    assert s.state == State.COMPLETE and not s.busy
    s.renew("t1", fence)  # the stalled router runs again: the reservation is its own again
    assert s.busy and not s.snapshot()["lapsed"]
    with pytest.raises(SlotError) as e:
        s.reserve("t2", "k", "other-router")
    assert e.value.code == "busy"
    time.sleep(0.06)
    s.expire_leases()
    tr = s.attach_decode("t1", "k", fence)  # a late decode request revives it too, and runs
    s.wait_complete(tr, 1)
    s.release(tr)
    fence = s.reserve("t3", "k", "stalled-router").reservation.fence
    time.sleep(0.06)
    s.expire_leases()
    t4 = s.reserve("t4", "k", "other-router")  # another router's reservation takes the lapsed slot at once
    assert s.current is t4 and s.reservations_expired == 1 and s._ended["t3"].reason == "lease_expired"
    with pytest.raises(SlotError) as e:
        s.renew("t3", fence)
    assert e.value.code == "reservation_lost" and "lease_expired" in e.value.message


def _lapsed_decode() -> tuple:
    """A slot (lease 0.05 s) whose reservation t1 is decoding and has just lapsed: (slot, t1's transfer)."""
    s, _ = _slot(lease_s=0.05)
    tr = reserve_and_attach(s, "t1", "k")
    s.complete("t1", s.admit("t1", "k", 1, 1, 1, None, 1), True)
    s.wait_complete(tr, 1)
    s.start_decoding(tr)
    time.sleep(0.06)
    s.expire_leases()
    return s, tr


def test_a_lapsed_decode_is_cancelled_for_the_next_reservation_and_a_waiting_one_fails() -> None:
    s, tr = _lapsed_decode()
    assert not tr.cancel.is_set() and s.state == State.DECODING and not s.busy  # lapsed: nobody asked for the node yet
    with pytest.raises(SlotError) as e:  # another router asks: the decode stops at its next step, the router waits
        s.reserve("t2", "k", "other-router")
    assert e.value.code == "busy" and tr.cancel.is_set() and s.state == State.CANCELLING and s.busy
    s.release(tr, "cancelled")
    assert s.state == State.FREE and s._ended["t1"].reason == "lease_expired"
    tr = reserve_and_attach(s, "t3", "k")
    time.sleep(0.06)
    s.expire_leases()
    s.reserve("t4", "k", "other-router")
    with pytest.raises(SlotError) as e:  # its decode request waited for KV that another router's reservation took over
        s.wait_complete(tr, 1)
    assert e.value.code == "reservation_lost" and "not renewed" in e.value.message


def test_a_lapsed_decode_is_cancelled_after_the_grace() -> None:
    s, tr = _lapsed_decode()
    assert not tr.cancel.is_set()
    time.sleep(LAPSE_GRACE_LEASES * 0.05 + 0.01)
    s.expire_leases()
    assert tr.cancel.is_set() and s.state == State.CANCELLING and s.reservations_expired == 1


def test_time_the_node_was_held_up_is_added_to_the_lease() -> None:
    s, _ = _slot(lease_s=0.05)
    s.reserve("t1", "k", "a")
    time.sleep(0.06)
    s.expire_leases(held_up_s=1.0)  # the clock's tick came a second late: renewals may be waiting unread
    assert s.state == State.RESERVED


def test_stale_generation_done_is_ignored_and_readmit_supersedes() -> None:
    s, _ = _slot()
    reserve_and_attach(s, "t1", "k")
    g1 = s.admit("t1", "k", 10, 1, 100, None, conn_id=1)
    g2 = s.admit("t1", "k", 10, 1, 100, None, conn_id=2)  # duplicate admit: new generation
    assert g2 > g1
    assert s.complete("t1", g1, True)[0] is False  # late writer of the old generation
    assert s.state == State.TRANSFERRING
    s.sender_gone(1)  # the old connection closing does not fail the new generation
    assert s.state == State.TRANSFERRING
    assert s.complete("t1", g2, True)[0] is True
    assert s.complete("t1", g2, True)[0] is False  # duplicate done
    with pytest.raises(SlotError):
        s.admit("t1", "k", 10, 1, 100, None, conn_id=3)  # already complete


def test_kv_timeout_frees_the_slot() -> None:
    s, ev = _slot()
    tr = reserve_and_attach(s, "t1", "k")
    with pytest.raises(SlotError) as e:
        s.wait_complete(tr, 0.05)
    assert e.value.code == "kv_timeout" and s.state == State.FREE and ("disarm",) in ev


def test_sender_gone_fails_the_waiting_decode() -> None:
    s, _ = _slot()
    tr = reserve_and_attach(s, "t1", "k")
    s.admit("t1", "k", 10, 1, 100, None, conn_id=7)
    threading.Timer(0.05, s.sender_gone, args=(7,)).start()
    with pytest.raises(SlotError) as e:
        s.wait_complete(tr, 5)
    assert e.value.code == "transfer_failed" and "closed mid-transfer" in e.value.message
    assert s.state == State.FREE


def test_cancel_while_waiting_and_while_decoding() -> None:
    s, _ = _slot()
    tr = reserve_and_attach(s, "t1", "k")
    threading.Timer(0.05, s.cancel, args=("t1",)).start()
    with pytest.raises(SlotError) as e:
        s.wait_complete(tr, 5)
    assert e.value.code == "cancelled" and s.state == State.FREE
    tr = reserve_and_attach(s, "t2", "k")
    s.complete("t2", s.admit("t2", "k", 1, 1, 1, None, 1), True)
    s.wait_complete(tr, 1)
    s.start_decoding(tr)
    assert s.cancel("t2") and s.state == State.CANCELLING and tr.cancel.is_set()
    assert not s.cancel("nope")


def test_orphaned_admit_is_reaped() -> None:
    s, _ = _slot(orphan_timeout_s=0.01)
    s.reserve("t0", "k", "a")
    time.sleep(0.02)
    s.reap_orphans()
    assert s.state == State.RESERVED  # before its KV came, only the lease bounds a reservation (a prefill may queue long)
    s.cancel("t0")
    s.reserve("t1", "k", "a")
    s.admit("t1", "k", 1, 1, 1, None, 1)
    time.sleep(0.02)
    s.reap_orphans()
    assert s.state == State.FREE


def test_a_late_decode_request_cannot_take_the_slot_of_its_ended_transfer() -> None:
    """Seen on the loaded CI box: the router cancelled a transfer whose decode handler was stalled; the handler then
    reserved the free slot for the dead transfer and the node stayed busy for tens of seconds."""
    s, _ = _slot()
    fence = s.reserve("t1", "k", "a").reservation.fence
    g = s.admit("t1", "k", 10, 1, 100, None, conn_id=1)
    s.complete("t1", g, True)
    assert s.cancel("t1") and s.state == State.FREE  # no decode request had joined: freed at once
    with pytest.raises(SlotError) as e:
        s.attach_decode("t1", "k", fence)
    assert e.value.code == "cancelled" and "already ended here (cancelled)" in e.value.message
    with pytest.raises(SlotError) as e:
        s.reserve("t1", "k", "a")
    assert e.value.code == "cancelled"
    assert s.state == State.FREE and not s.busy
    tr = reserve_and_attach(s, "t2", "k")  # any other transfer still takes it
    tr2 = s.admit("t2", "k", 10, 1, 100, None, conn_id=1)
    s.complete("t2", tr2, True)
    s.wait_complete(tr, 1)
    s.start_decoding(tr)
    s.release(tr)
    with pytest.raises(SlotError) as e:
        s.attach_decode("t2", "k", tr.reservation.fence)
    assert e.value.code == "duplicate"


def test_a_decode_request_that_comes_after_its_transfer_failed_learns_the_failure() -> None:
    """The router posts /v1/decode after the prefill returns: a KV that failed its checksum before then must reach the
    router as that failure (502 kv_checksum_mismatch), not as `cancelled`; the request still cannot take the slot."""
    s, _ = _slot()
    fence = s.reserve("t1", "k", "a").reservation.fence
    g = s.admit("t1", "k", 10, 1, 100, None, conn_id=1)
    s.complete("t1", g, False, "layer 0 digest differs", code="kv_checksum_mismatch")
    assert s.state == State.FREE
    with pytest.raises(SlotError) as e:
        s.attach_decode("t1", "k", fence)
    assert e.value.code == "kv_checksum_mismatch" and "layer 0 digest differs" in e.value.message, e.value.message
    with pytest.raises(SlotError) as e:  # a caller without the transfer's token learns only that it ended
        s.attach_decode("t1", "other", fence)
    assert e.value.code == "cancelled"
    assert s.state == State.FREE and not s.busy
    s.reserve("t2", "k", "a")  # another transfer takes the slot
    assert s.current is not None and s.current.transfer_id == "t2"


def test_ended_transfers_are_remembered_boundedly() -> None:
    from tilepd.runtime import slot as slot_mod

    s, _ = _slot()
    for i in range(slot_mod.ENDED_REMEMBERED + 10):
        s.reserve(f"t{i}", "k")
        g = s.admit(f"t{i}", "k", 10, 1, 100, None, conn_id=1)
        s.complete(f"t{i}", g, True)
        s.cancel(f"t{i}")
    assert len(s._ended) == slot_mod.ENDED_REMEMBERED and "t0" not in s._ended


def test_a_draining_slot_takes_a_canary_transfer_only() -> None:
    """A restarted node comes back draining; the supervisor's canary (transfer id canary-...) is the one request it
    takes, from either side, before it is undrained."""
    s, _ = _slot()
    s.draining = True
    for tid in ("tx-1", "canaryish-1"):
        with pytest.raises(SlotError) as e:
            s.reserve(tid, "k")
        assert e.value.code == "draining"
        with pytest.raises(SlotError) as e:
            s.admit(tid, "k", 10, 1, 100, None, conn_id=1)
        assert e.value.code == "busy"
    tr = reserve_and_attach(s, "canary-1", "k")
    g = s.admit("canary-1", "k", 10, 1, 100, None, conn_id=1)
    assert s.complete("canary-1", g, True) == (True, "")
    s.wait_complete(tr, 1)
    s.release(tr)
    fence = s.reserve("canary-2", "k").reservation.fence
    g = s.admit("canary-2", "k", 10, 1, 100, None, conn_id=2)  # the KV first, as the prefill sends it
    assert s.state == State.TRANSFERRING and g > fence
