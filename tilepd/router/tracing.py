"""OpenTelemetry traces of the request timeline (issue 17): off unless `RouterConfig.otlp_endpoint` names a collector.

One trace per request: a root span `tilepd.request` (the router's whole request, continuing the client's
W3C `traceparent` when it sent one) with one child span per timeline phase (tilepd/router/timeline.py). The
router sends the root span's `traceparent` to vLLM (prefill, native pool) and to the decode node, so a vLLM
started with `--otlp-traces-endpoint` puts its own spans in the same trace and the node logs the trace id.
The node's phases (kv_wait, node_queue, convert, inject, decode) are exported by the node itself when it has a
collector too (`DecodeServerConfig.otlp_endpoint`, tilepd/runtime/tracing.py; its final timings then say `traced`);
for a node that does not trace, the router exports them from the timings the node returned, as children of a
`tilepd.decode_node` span (attribute `tilepd.reported_by=node`). The connector (inside vLLM's worker) exports its
hand-off (`tilepd.connector`: `kv_stage`, `kv_send`) under the request span, from the `tilepd_traceparent` the
router puts beside its marker (tilepd/connector/tracing.py).

Export: the SDK's BatchSpanProcessor and OTLP/HTTP protobuf exporter (opentelemetry-sdk and
opentelemetry-exporter-otlp-proto-http; vLLM depends on both, `pip install tilepd[tracing]` elsewhere). Spans
are built once the request is over, with the timeline's times (the SDK takes explicit start/end times), so
tracing costs the request path nothing but the root span's start.
"""

from __future__ import annotations

import logging
from typing import Any

from tilepd.otel import otel_export, traces_url
from tilepd.router.timeline import Timeline

log = logging.getLogger("tilepd.router")


class Tracing:
    """The router's tracer provider and exporter; `exporter` replaces the OTLP one (tests: InMemorySpanExporter)."""

    def __init__(self, endpoint: str | None, service_name: str = "tilepd-router", exporter: Any = None) -> None:
        self.endpoint = endpoint
        self.otel = otel_export(endpoint, {"service.name": service_name}, "tilepd.router", exporter)
        self.provider, self.tracer, self.propagator = self.otel.provider, self.otel.tracer, self.otel.propagator

    def start(self, tl: Timeline, headers: Any, name: str) -> None:
        """Open the request's root span at the timeline's start (parent: the client's traceparent, if any)."""
        from opentelemetry import trace

        parent = self.propagator.extract({k: v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")})
        span = self.tracer.start_span(name, context=parent, start_time=tl.wall0_ns, kind=trace.SpanKind.SERVER,
                                      attributes={"tilepd.request_id": tl.request_id})
        tl.trace_span = span
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        tl.trace_headers = carrier
        ctx = span.get_span_context()
        tl.attrs["trace_id"] = f"{ctx.trace_id:032x}"

    def finish(self, tl: Timeline, status: int) -> None:
        """Children per phase, then end the root span at the timeline's end."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        root = getattr(tl, "trace_span", None)
        if root is None:
            return
        try:
            ctx = trace.set_span_in_context(root)
            node_parent = None
            node_traced = bool(tl.attrs.get("node_traced"))
            for s in tl.spans:
                if s.source == "node" and node_traced:
                    continue  # the node exported these itself, in this trace
                attrs = {f"tilepd.{k}": _attr(v) for k, v in s.attrs.items()}
                attrs["tilepd.reported_by"] = s.source
                parent_ctx = ctx
                if s.source == "node":
                    if node_parent is None or node_parent[1] != s.attrs.get("node"):
                        group = self.tracer.start_span("tilepd.decode_node", context=ctx, start_time=tl.epoch_ns(s.start),
                                                       attributes={"tilepd.reported_by": "node", "tilepd.node": str(s.attrs.get("node", ""))})
                        node_parent = (group, s.attrs.get("node"), s)
                    node_parent = (node_parent[0], node_parent[1], s)
                    parent_ctx = trace.set_span_in_context(node_parent[0])
                else:
                    if node_parent is not None:
                        node_parent[0].end(end_time=tl.epoch_ns(node_parent[2].end))
                        node_parent = None
                child = self.tracer.start_span(s.name, context=parent_ctx, start_time=tl.epoch_ns(s.start), attributes=attrs)
                child.end(end_time=tl.epoch_ns(s.end))
            if node_parent is not None:
                node_parent[0].end(end_time=tl.epoch_ns(node_parent[2].end))
            for k, v in tl.attrs.items():
                if k != "trace_id":
                    root.set_attribute(f"tilepd.{k}", _attr(v))
            for k, v in tl.phases_ms().items():
                root.set_attribute(f"tilepd.phase_ms.{k}", round(v, 3))
            root.set_attribute("http.response.status_code", status)
            if status >= 500:
                root.set_status(Status(StatusCode.ERROR))
        finally:
            root.end(end_time=tl.epoch_ns(tl.t_end if tl.t_end is not None else tl.t0 + tl.total_ms / 1e3))
            tl.trace_span = None

    def shutdown(self) -> None:
        self.otel.shutdown(log)


def _attr(v: Any) -> Any:
    return v if isinstance(v, (str, bool, int, float)) else str(v)


def make_tracing(endpoint: str | None) -> Tracing | None:
    if not endpoint:
        return None
    t = Tracing(endpoint)
    log.info("event=tracing otlp_endpoint=%s", traces_url(endpoint))
    return t
