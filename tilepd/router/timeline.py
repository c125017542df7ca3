"""One timeline per request: named phases on the router's monotonic clock, end to end (issue 17).

The router records each phase it lives through as a span (start, end on `time.perf_counter`), one after
the other, so the phases tile the request from the moment it arrived to the moment its log line is
written. The decode node reports its own phases in its final `timings` (INTERFACES §4); they happened
inside the router's decode stretch (prefill answered -> the node's done line), so the router places
them there and calls the rest of that stretch `relay`.

Phases (in the order a low-latency request meets them; each may repeat after a node fault):

| phase | clock | what |
| --- | --- | --- |
| `admission` | router | read, authenticate, validate, route, capability gate, render the prompt |
| `queue_wait` | router | waiting for a decode-node lease |
| `prefill` | router | the vLLM prefill call (max_tokens=1) until its answer: vLLM's queue, the forward, and the connector staging the KV (the send runs on in the background) |
| `kv_wait` | node | /v1/decode arrived -> the KV had landed (the part of the transfer not hidden behind the prefill) |
| `node_queue` | node | waiting for the node's engine thread |
| `convert` | node | received bytes -> the engine's cache layout |
| `inject` | node | into the engine's static cache |
| `decode` | node | the engine's decode loop (attrs: tokens, tokens_per_s); when the router ended the decode itself (a stop string, the client gone) no done line comes: the whole stretch is `decode` (`measured_by=router`) |
| `relay` | router | the rest of the decode stretch: HTTP to and from the node, detokenising, stop strings, writing to the client (a slow client shows here) |
| `failed_attempt` | router | time on a node that then failed the request (attrs: node, cause) |
| `native_continue` | router | the rest of a request the native pool finished after a node fault |
| `native_prefill`, `native_decode` | router | the native pool (stock vLLM P/D), for a request routed or fallen back there (attrs: reason) |
| `respond` | router | after the last token: the final chunk / JSON body until the log line |

`other` = total - the sum of the phases: time no phase covered (0 by construction on the paths above; a
new path that forgets to record a phase shows up here instead of vanishing). Node phases shorter than the
stretch they sit in leave `relay`; a node that claims more than the stretch (clock skew, never seen)
makes `relay` 0 and `other` negative, so the sum still equals the total.

Marks (points, not phases): `first_token` (TTFT as the router sees it: prefill answered).
Details (durations that overlap phases, not added): `transfer` (node: admit -> KV complete, the wire time
as the node sees it), `first_step` (node: the first decode step).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# node-reported timings (ms) -> the phase they become, in order
NODE_PHASES = (("wait_ms", "kv_wait"), ("queue_ms", "node_queue"), ("convert_ms", "convert"), ("inject_ms", "inject"),
               ("decode_ms", "decode"))
NODE_DETAILS = (("transfer_ms", "transfer"), ("first_step_ms", "first_step"))
PHASE_ORDER = ("admission", "queue_wait", "prefill", "failed_attempt", "kv_wait", "node_queue", "convert", "inject", "decode",
               "relay", "native_continue", "native_prefill", "native_decode", "respond")
# Server-Timing names (RFC 8941 tokens; browsers' devtools show them)
_TOKEN_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass
class Span:
    name: str
    start: float  # perf_counter seconds
    end: float
    attrs: dict[str, Any] = field(default_factory=dict)
    source: str = "router"  # "router" or "node" (placed from the node's timings)

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3


class Timeline:
    """The phases of one request. Not thread-safe: one request's coroutines only."""

    def __init__(self, request_id: str, t0: float | None = None) -> None:
        self.request_id = request_id
        self.t0 = time.perf_counter() if t0 is None else t0
        # wall clock at t0 (for OpenTelemetry, whose spans carry epoch nanoseconds)
        self.wall0_ns = time.time_ns() - int((time.perf_counter() - self.t0) * 1e9)
        self.spans: list[Span] = []
        self.marks: dict[str, float] = {}
        self.details: dict[str, float] = {}  # name -> ms (overlapping, not added)
        self.attrs: dict[str, Any] = {}  # route, reason, node, fallback, transfers, tokens, ...
        self.cursor = self.t0  # where the next sequential phase starts
        self.t_end: float | None = None
        self.trace_span: Any = None  # tracing.py: the OpenTelemetry root span while the request runs
        self.trace_headers: dict[str, str] = {}  # `traceparent` for the upstream calls (empty: tracing off)

    # -- recording ---------------------------------------------------------------------
    def add(self, name: str, start: float, end: float, *, source: str = "router", **attrs: Any) -> Span:
        span = Span(name, start, max(end, start), attrs, source)
        self.spans.append(span)
        self.cursor = max(self.cursor, span.end)
        return span

    def upto(self, name: str, end: float | None = None, **attrs: Any) -> Span:
        """A phase from where the last one ended until `end` (default now)."""
        return self.add(name, self.cursor, time.perf_counter() if end is None else end, **attrs)

    @contextmanager
    def phase(self, name: str, **attrs: Any) -> Iterator[dict[str, Any]]:
        """A phase around a block; the block may add attributes to the yielded dict. Recorded on errors too."""
        start = time.perf_counter()
        try:
            yield attrs
        finally:
            self.add(name, start, time.perf_counter(), **attrs)

    def mark(self, name: str, t: float | None = None) -> None:
        self.marks[name] = time.perf_counter() if t is None else t

    def node_stretch(self, start: float, end: float, timings: dict[str, Any] | None, **attrs: Any) -> None:
        """The decode stretch [start, end] on the router's clock, split with the node's reported phases; the rest is relay."""
        t = start
        if timings and timings.get("traced"):
            self.attrs["node_traced"] = True  # the node exported its own spans (tilepd/runtime/tracing.py)
        if not timings:  # no done line (the router stopped the decode: stop string, client gone, error): the router's view only
            self.add("decode", start, end, measured_by="router", **attrs)
            return
        for key, name in NODE_PHASES:
            ms = timings.get(key)
            if not isinstance(ms, (int, float)) or ms <= 0:
                continue
            extra = dict(attrs)
            if name == "decode":
                for k in ("tokens", "tokens_per_s"):
                    if isinstance(timings.get(k), (int, float)):
                        extra[k] = timings[k]
            dur = min(ms / 1e3, max(end - t, 0.0))
            self.add(name, t, t + dur, source="node", **extra)
            t += dur
        for key, name in NODE_DETAILS:
            if isinstance(timings.get(key), (int, float)):
                self.details[name] = float(timings[key])
        self.add("relay", t, end, **attrs)

    def close(self, t_end: float | None = None) -> None:
        if self.t_end is None:
            self.t_end = time.perf_counter() if t_end is None else t_end

    # -- views -------------------------------------------------------------------------
    @property
    def total_ms(self) -> float:
        end = self.t_end if self.t_end is not None else time.perf_counter()
        return (end - self.t0) * 1e3

    def phases_ms(self) -> dict[str, float]:
        """Phase -> ms (repeats summed), in PHASE_ORDER then first-seen order, plus `other` (total - the sum)."""
        out: dict[str, float] = {}
        for name in PHASE_ORDER:
            for s in self.spans:
                if s.name == name:
                    out[name] = out.get(name, 0.0) + s.ms
        for s in self.spans:
            if s.name not in PHASE_ORDER:
                out[s.name] = out.get(s.name, 0.0) + s.ms
        out["other"] = self.total_ms - sum(out.values())
        return out

    def log_fields(self) -> str:
        """`timeline=phase:ms,...` (+ `ttft_ms`, `detail=...`, the decode's tokens/s): fields of the router's event=done line."""
        parts = [f"timeline={','.join(f'{k}:{v:.1f}' for k, v in self.phases_ms().items())}"]
        if "first_token" in self.marks:
            parts.append(f"ttft_ms={(self.marks['first_token'] - self.t0) * 1e3:.1f}")
        for s in self.spans:
            if s.name == "decode" and "tokens_per_s" in s.attrs:
                parts.append(f"node_tokens={int(s.attrs.get('tokens', 0))} tokens_per_s={float(s.attrs['tokens_per_s']):.1f}")
        if self.details:
            parts.append("detail=" + ",".join(f"{k}:{v:.1f}" for k, v in self.details.items()))
        if "trace_id" in self.attrs:
            parts.append(f"trace_id={self.attrs['trace_id']}")
        return " ".join(parts)

    def server_timing(self, *, partial: bool = False) -> str:
        """A `Server-Timing` header value: one metric per phase (dur in ms) and `total`; `partial`: the phases so far, no total."""
        items = []
        phases = self.phases_ms()
        other = phases.pop("other")
        causes = [f"{s.attrs.get('node', '?')} {s.attrs.get('cause', '?')}" for s in self.spans if s.name == "failed_attempt"]
        for name, ms in phases.items():
            desc = f';desc="{_quoted("; ".join(causes))}"' if name == "failed_attempt" and causes else ""
            items.append(f"{_token(name)};dur={ms:.1f}{desc}")
        if not partial:
            if abs(other) >= 0.05:
                items.append(f"other;dur={other:.1f}")
            items.append(f"total;dur={self.total_ms:.1f}")
        reason = self.attrs.get("fallback")
        if reason:
            items.append(f'fallback;desc="{_quoted(str(reason))}"')
        return ", ".join(items)

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "total_ms": round(self.total_ms, 3), "attrs": dict(self.attrs),
                "phases_ms": {k: round(v, 3) for k, v in self.phases_ms().items()},
                "spans": [{"name": s.name, "start_ms": round((s.start - self.t0) * 1e3, 3), "ms": round(s.ms, 3), "source": s.source,
                           **({"attrs": s.attrs} if s.attrs else {})} for s in self.spans],
                "marks_ms": {k: round((v - self.t0) * 1e3, 3) for k, v in self.marks.items()},
                "details_ms": {k: round(v, 3) for k, v in self.details.items()}}

    def epoch_ns(self, t: float) -> int:
        return self.wall0_ns + int((t - self.t0) * 1e9)


def _token(name: str) -> str:
    return "".join(ch if ch in _TOKEN_OK else "_" for ch in name) or "_"


def _quoted(text: str) -> str:
    return "".join(ch for ch in text if ch not in '"\\' and 0x20 <= ord(ch) < 0x7F)[:200]


def parse_server_timing(value: str) -> dict[str, dict[str, Any]]:
    """`Server-Timing` -> {name: {"dur": float?, "desc": str?}} (for tests and clients)."""
    out: dict[str, dict[str, Any]] = {}
    for item in value.split(","):
        parts = [p.strip() for p in item.split(";")]
        if not parts or not parts[0]:
            continue
        entry: dict[str, Any] = {}
        for p in parts[1:]:
            k, _, v = p.partition("=")
            v = v.strip().strip('"')
            entry[k.strip()] = float(v) if k.strip() == "dur" else v
        out[parts[0]] = entry
    return out


def parse_log_timeline(field_value: str) -> dict[str, float]:
    """The `timeline=` field of an event=done line -> {phase: ms}."""
    out: dict[str, float] = {}
    for item in field_value.split(","):
        name, _, ms = item.partition(":")
        if name and ms:
            out[name] = float(ms)
    return out
