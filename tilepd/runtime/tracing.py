"""OpenTelemetry spans of the decode node's phases (issue 17), when `DecodeServerConfig.otlp_endpoint` names a collector.

A `/v1/decode` that carries a W3C `traceparent` (the router sends its request span's) gets a `tilepd.decode_node`
span in that trace, with one child per phase the node's final `timings` report (kv_wait, node_queue, convert,
inject, decode; INTERFACES §4), placed on this node's clock from the moment the request arrived. The final
`timings` then say `"traced": 1`, and the router leaves these phases out of its own export (tilepd/router/tracing.py
exports them on the node's behalf for a node that does not trace). Export: the SDK's BatchSpanProcessor and the
OTLP/HTTP protobuf exporter, off the request path.
"""

from __future__ import annotations

import logging
from typing import Any

from tilepd.otel import otel_export

log = logging.getLogger("tilepd.runtime")

PHASES = (("wait_ms", "kv_wait"), ("queue_ms", "node_queue"), ("convert_ms", "convert"), ("inject_ms", "inject"), ("decode_ms", "decode"))


class NodeTracing:
    def __init__(self, endpoint: str | None, node: str, exporter: Any = None) -> None:
        self.node = node
        self.otel = otel_export(endpoint, {"service.name": "tilepd-decode", "tilepd.node": node}, "tilepd.runtime", exporter)
        self.provider, self.tracer, self.propagator = self.otel.provider, self.otel.tracer, self.otel.propagator

    def export(self, traceparent: str, arrived_ns: int, timings: dict[str, Any], transfer_id: str, finish: str) -> bool:
        """The node's phases as spans under the caller's span; False when `traceparent` is not a valid context."""
        from opentelemetry import trace

        parent = self.propagator.extract({"traceparent": traceparent})
        if not trace.get_current_span(parent).get_span_context().is_valid:
            return False
        end_ns = arrived_ns + int(float(timings.get("node_ms", 0.0)) * 1e6)
        group = self.tracer.start_span("tilepd.decode_node", context=parent, start_time=arrived_ns, kind=trace.SpanKind.SERVER,
                                       attributes={"tilepd.node": self.node, "tilepd.transfer_id": transfer_id, "tilepd.finish": finish,
                                                   "tilepd.reported_by": "node"})
        ctx = trace.set_span_in_context(group)
        t = arrived_ns
        for key, name in PHASES:
            ms = timings.get(key)
            if not isinstance(ms, (int, float)) or ms <= 0:
                continue
            attrs: dict[str, Any] = {"tilepd.reported_by": "node", "tilepd.node": self.node}
            if name == "decode":
                attrs.update({"tilepd.tokens": int(timings.get("tokens", 0)), "tilepd.tokens_per_s": float(timings.get("tokens_per_s", 0.0))})
            span = self.tracer.start_span(name, context=ctx, start_time=t, attributes=attrs)
            t += int(ms * 1e6)
            span.end(end_time=t)
        if "transfer_ms" in timings:
            group.set_attribute("tilepd.transfer_ms", float(timings["transfer_ms"]))
        group.end(end_time=max(end_ns, t))
        return True

    def shutdown(self) -> None:
        self.otel.shutdown(log)


def make_node_tracing(endpoint: str | None, node: str) -> NodeTracing | None:
    if not endpoint:
        return None
    t = NodeTracing(endpoint, node)
    log.info("event=tracing otlp_endpoint=%s", endpoint)
    return t
