"""OpenTelemetry spans of the connector's hand-off (issue 17): staging and the send, in the request's trace.

The router puts its request span's W3C `traceparent` in `kv_transfer_params["tilepd_traceparent"]`, beside
(not inside) the `tilepd` marker, so a connector of an older tilepd ignores it instead of refusing the marker.
When `kv_connector_extra_config.otlp_endpoint` names a collector, the worker exports, once the send is over,
a `tilepd.connector` span with two children: `kv_stage` (first layer copy until the slot is handed to the
sender: it spans the prefill's forward) and `kv_send` (waiting for the peer, the wire, the node's ack).
Spans are built after the fact from perf_counter times, off vLLM's forward path.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from tilepd.otel import otel_export, require_otel

log = logging.getLogger("tilepd.connector")

TRACEPARENT_KEY = "tilepd_traceparent"
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def traceparent_of(kv_transfer_params: Any) -> str | None:
    """The router's traceparent, when well formed (anything else is ignored: it only ever feeds a trace)."""
    if not isinstance(kv_transfer_params, dict):
        return None
    v = kv_transfer_params.get(TRACEPARENT_KEY)
    return v if isinstance(v, str) and _TRACEPARENT.match(v) else None


class ConnectorTracing:
    """The worker's tracer; `exporter` replaces the OTLP one (tests: InMemorySpanExporter)."""

    def __init__(self, endpoint: str | None, exporter: Any = None) -> None:
        self.otel = otel_export(endpoint, {"service.name": "tilepd-connector"}, "tilepd.connector", exporter)
        self._sync_clocks()

    def _sync_clocks(self) -> None:
        """perf_counter -> epoch, read again for every hand-off: one pair read when vLLM started went stale by 18 s
        once the machine was paused (the monotonic clock stops, the wall clock does not) and the connector's spans
        then began before the router's request."""
        self._wall_minus_perf_ns = time.time_ns() - int(time.perf_counter() * 1e9)

    def epoch_ns(self, t: float) -> int:
        return self._wall_minus_perf_ns + int(t * 1e9)

    def handoff(self, traceparent: str, *, t_stage: float, t_staged: float, t_send: float, t_end: float, ok: bool,
                attrs: dict[str, Any]) -> None:
        """One hand-off's spans under the router's request span; never raises (a trace never fails a send)."""
        try:
            from opentelemetry import trace
            from opentelemetry.trace import Status, StatusCode

            self._sync_clocks()
            parent = self.otel.propagator.extract({"traceparent": traceparent})
            clean = {f"tilepd.{k}": (v if isinstance(v, (str, bool, int, float)) else str(v)) for k, v in attrs.items() if v is not None}
            group = self.otel.tracer.start_span("tilepd.connector", context=parent, start_time=self.epoch_ns(t_stage), attributes=clean)
            ctx = trace.set_span_in_context(group)
            for name, a, b in (("kv_stage", t_stage, t_staged), ("kv_send", t_send, t_end)):
                self.otel.tracer.start_span(name, context=ctx, start_time=self.epoch_ns(a)).end(end_time=self.epoch_ns(max(a, b)))
            if not ok:
                group.set_status(Status(StatusCode.ERROR, str(attrs.get("code", "failed"))))
            group.end(end_time=self.epoch_ns(t_end))
        except Exception as exc:  # noqa: BLE001
            log.warning("tilepd-connector event=trace_error error=%r", exc)

    def shutdown(self) -> None:
        self.otel.shutdown(log)


def make_connector_tracing(endpoint: str | None) -> ConnectorTracing | None:
    """None unless a collector is named; a named one without opentelemetry installed refuses (vLLM does not start)."""
    if not endpoint:
        return None
    require_otel(endpoint, "router.otlp_endpoint (the connector exports its hand-off spans to the router's collector)")
    return ConnectorTracing(endpoint)
