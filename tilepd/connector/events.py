"""One log line per connector event, carrying the running counters.

vLLM's own /metrics does not include third-party connector counters, so every
event line ends with the counters of the process that logged it; a test or an
operator greps the last ``tilepd-connector`` line of each role. Format::

    tilepd-connector role=worker event=sent req=cmpl-1 transfer_id=tx-1 bytes=65536 ... \
        counters={"claimed":0,"sent":1,"bytes":65536,"refused":0,"retries":0,"failures":0}
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from typing import Any

from tilepd.contracts.logging_setup import LOG_FORMAT

COUNTER_NAMES = ("claimed", "sent", "bytes", "refused", "retries", "failures", "staged")

_log = logging.getLogger("tilepd.connector")


def ensure_logging() -> None:
    """Give tilepd's loggers a stderr handler inside vLLM (which only configures 'vllm.*')."""
    root = logging.getLogger("tilepd")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(h)
        root.setLevel(logging.INFO)
        root.propagate = False


class EventLog:
    """Counters for one connector instance plus the event line writer."""

    def __init__(self, role: str):
        self.role = role
        self._lock = threading.Lock()
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)

    def count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def event(self, event: str, req: str | None, *, level: int = logging.INFO, **fields: Any) -> None:
        parts = [f"role={self.role}", f"event={event}", f"req={req or '-'}"]
        parts += [f"{k}={_fmt(v)}" for k, v in fields.items()]
        parts.append("counters=" + json.dumps(self.snapshot(), separators=(",", ":")))
        _log.log(level, "tilepd-connector " + " ".join(parts))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    s = str(v)
    return json.dumps(s) if (" " in s or not s) else s


def parse_event_lines(text: str) -> list[dict[str, Any]]:
    """Parse the event lines out of a log (for tests and the bench)."""
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        i = line.find("tilepd-connector ")
        if i < 0:
            continue
        body = line[i + len("tilepd-connector ") :]
        head, _, counters = body.partition(" counters=")
        rec: dict[str, Any] = {}
        for tok in _split(head):
            k, _, v = tok.partition("=")
            rec[k] = json.loads(v) if v.startswith('"') else v
        try:
            rec["counters"] = json.loads(counters)
        except json.JSONDecodeError:
            rec["counters"] = {}
        out.append(rec)
    return out


def _split(s: str) -> list[str]:
    """Split on spaces outside double quotes."""
    toks, cur, quoted, esc = [], [], False, False
    for ch in s:
        if esc:
            cur.append(ch)
            esc = False
        elif ch == "\\" and quoted:
            cur.append(ch)
            esc = True
        elif ch == '"':
            quoted = not quoted
            cur.append(ch)
        elif ch == " " and not quoted:
            if cur:
                toks.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        toks.append("".join(cur))
    return toks
