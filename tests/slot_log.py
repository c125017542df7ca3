"""A decode node's own log as the witness of its slot (issue 28): every reservation it granted was freed before it
granted the next, and every decode it ran lay inside its own transfer's reservation."""

from __future__ import annotations

import re

EVENT = re.compile(r"event=(reserved|freed) transfer_id=(\S+) (?:holder=(.*?) fence=|reason=(\S+))")
DECODED = re.compile(r"event=decode_start transfer_id=(\S+)")


def slot_events(log: str) -> list[tuple[str, str, str]]:
    """(reserved|freed, transfer id, holder or reason), in the node's order."""
    return [(m[1], m[2], m[3] if m[1] == "reserved" else m[4]) for m in EVENT.finditer(log)]


def check_one_at_a_time(log: str) -> set[str]:
    """Assert that the node's reservations never overlap and each decode ran inside its own; the holders seen (names)."""
    held: str | None = None
    holders: set[str] = set()
    inside: dict[str, bool] = {}
    for line in log.splitlines():
        m = EVENT.search(line)
        if m is not None and m[1] == "reserved":
            assert held is None, f"reservation {m[2]} granted while {held} still held the slot"
            held = m[2]
            holders.add(str(m[3]).split(" (")[0])
        elif m is not None:
            assert held == m[2], f"freed {m[2]} while {held} held the slot"
            held = None
        d = DECODED.search(line)
        if d is not None:
            inside[d[1]] = held == d[1]
    assert all(inside.values()), f"decodes outside their own reservation: {[t for t, ok in inside.items() if not ok]}"
    return holders
