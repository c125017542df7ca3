"""One client request through the router: what it asked, where it goes, its timeline, and its bookkeeping.

A `Call` is made when the request arrives (request id, start time, timeline) and filled in by admission (the body,
its validated form, the route). Whatever way the request ends, it is booked here, once: the route and response
counters, the timeline closed into the phase histograms and the trace, one log line, and on an error the headers
that say which path refused it (`x-tilepd-route`, `x-tilepd-route-reason`, `x-request-id`, `server-timing`).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from starlette.requests import Request

from tilepd.router.divergence_watch import asked_to_verify
from tilepd.router.errors import PassThroughError, RouterError
from tilepd.router.lowlatency import Finished, LowLatencyRun
from tilepd.router.protocol import ChatCompletionRequest, CompletionRequest, Endpoint
from tilepd.router.routing import Route
from tilepd.router.state import RouterState
from tilepd.router.timeline import Timeline

log = logging.getLogger("tilepd.router")


def request_id(given: str | None) -> str:
    """The client's x-request-id made safe for log lines and headers (printable, no spaces or `=`, at most 128), else a fresh one."""
    if given:
        safe = "".join(ch if (ch.isalnum() or ch in "-_.:/+@") and ord(ch) < 128 else "_" for ch in given.strip())[:128]
        if safe:
            return safe
    return f"req-{uuid.uuid4().hex[:16]}"


class Call:
    """A request's state from arrival to its log line (nano-vllm's `Sequence`: the steps read and fill it in)."""

    body: dict[str, Any]  # the client's JSON object as sent (the native pool relays it), set by admission
    req: CompletionRequest | ChatCompletionRequest  # the body validated, set by admission
    route: Route  # the pool serving it and why; a fallback replaces it

    def __init__(self, state: RouterState, request: Request, endpoint: Endpoint) -> None:
        self.state = state
        self.request = request
        self.endpoint = endpoint
        self.t0 = time.perf_counter()
        self.rid = request_id(request.headers.get("x-request-id"))
        self.timeline = Timeline(self.rid, self.t0)
        self.timeline.attrs["endpoint"] = endpoint
        if state.tracing is not None:
            state.tracing.start(self.timeline, request.headers, f"POST {request.url.path}")

    def route_headers(self) -> dict[str, str]:
        return {"x-tilepd-route": self.route.pool, "x-tilepd-route-reason": self.route.reason, "x-request-id": self.rid}

    @property
    def native_by_choice(self) -> bool:
        """Routed native on purpose (header, model, default); any other reason is a fallback."""
        return self.route.reason in ("header", "model", "default")

    # -- bookkeeping: once per request ---------------------------------------------------
    def count(self, status: int) -> None:
        m = self.state.metrics
        m.routes.labels(self.route.pool, self.route.reason).inc()
        m.responses.labels(self.route.pool, str(status)).inc()
        m.request_seconds.labels(self.route.pool).observe(time.perf_counter() - self.t0)

    def close_timeline(self, status: int, t_end: float | None = None) -> None:
        """End the request's timeline: `respond` up to `t_end` (default now), the phase histograms, the trace. A stream
        ends when its last bytes were handed to the server: the generator's `finally` runs only once the server asks for
        more, after the client may already have them all."""
        tl = self.timeline
        if tl.t_end is not None:
            return
        if tl.spans:
            tl.upto("respond", end=t_end)
        tl.close(t_end)
        tl.attrs.setdefault("route", self.route.pool)
        tl.attrs.setdefault("reason", self.route.reason)
        hist = self.state.metrics.phase_seconds
        for phase, ms in tl.phases_ms().items():
            if ms > 0 and (phase != "other" or ms >= 0.05):
                hist.labels(phase, self.route.pool).observe(ms / 1e3)
        if self.state.tracing is not None:
            try:
                self.state.tracing.finish(tl, status)
            except Exception as exc:  # noqa: BLE001 - tracing never fails a request
                log.warning("req=%s event=tracing_error error=%r", tl.request_id, exc)

    def refused_at_admission(self, exc: RouterError) -> None:
        """A request refused before any pool (auth, JSON, validation, route): said with the request id, like every
        other answer; no pool counts it."""
        self.route = Route("none", exc.code or "refused")
        exc.headers.update(self.route_headers())
        self.timeline.upto("admission")
        self.close_timeline(exc.status)
        log.info("req=%s event=refused status=%d code=%s %s", self.rid, exc.status, exc.code, self.timeline.log_fields())

    def refused(self, exc: RouterError | PassThroughError, event: str, fields: str, headers: dict[str, str] | None = None) -> None:
        """A request that ends in an error before any byte went out (no pool would take it, the prefill or the native
        pool failed): counted on its route, the timeline closed, one `event` line with `fields`, and the error the
        client gets carries `headers` (default: the route's) and the phases so far."""
        self.count(exc.status)
        self.close_timeline(exc.status)
        log.info("req=%s event=%s %s %s", self.rid, event, fields, self.timeline.log_fields())
        exc.headers.update(headers if headers is not None else self.route_headers())
        exc.headers["server-timing"] = self.timeline.server_timing()

    def finished(self, run: LowLatencyRun, fin: Finished | None, status: int, outcome: str, t_end: float | None = None) -> None:
        """A low-latency request's end (streams: after its last bytes), with what its nodes did."""
        self.count(status)
        if fin is not None:
            self.state.metrics.completion_tokens.inc(fin.completion_tokens)
            if outcome == "ok" and self.state.watch is not None:  # its greedy tokens may be checked (divergence_watch.py)
                self.state.watch.offer(run, asked_to_verify(self.request.headers))
        tl = self.timeline  # the run's (LowLatencyRun records into the call's timeline)
        tl.attrs["outcome"] = outcome
        self.close_timeline(status, t_end)
        route = self.route
        log.info("req=%s event=done route=%s reason=%s node=%s status=%d outcome=%s prompt_tokens=%d completion_tokens=%s finish=%s "
                 "ms=%.1f prefill_ms=%s failovers=%d user=%s transfers=%s %s", self.rid, route.pool, route.reason, run.lease.node.name,
                 status, outcome, run.prompt_tokens, fin.completion_tokens if fin else "-", fin.finish_reason if fin else "-",
                 tl.total_ms, f"{fin.timings['prefill_ms']:.1f}" if fin and "prefill_ms" in fin.timings else "-", run.failovers,
                 run.user or "-", ",".join(run.transfers) or "-", _why(run) + tl.log_fields())

    def finished_native(self, status: int, outcome: str, t_end: float | None = None) -> None:
        """A native-pool request's end (streams: when the relay ends)."""
        self.count(status)
        self.close_timeline(status, t_end)
        chosen = self.native_by_choice
        log.info("req=%s event=done route=native reason=%s status=%d outcome=%s ms=%.1f runbook=%s %s%s", self.rid, self.route.reason,
                 status, outcome, self.timeline.total_ms, "-" if chosen else "RB-native-fallback",
                 f"fallback={self.route.reason} " if not chosen else "", self.timeline.log_fields())


def _why(run: LowLatencyRun) -> str:
    """`retries=<node>:<cause>;...` when nodes failed the request (the timeline's failed_attempt phases say how long)."""
    causes = [f"{s.attrs.get('node', '?')}:{s.attrs.get('cause', '?')}" for s in run.timeline.spans if s.name == "failed_attempt"]
    return f"retries={';'.join(causes)} " if causes else ""
