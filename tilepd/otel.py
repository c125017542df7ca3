"""The OpenTelemetry plumbing the router and the decode node share: one tracer provider with a batched OTLP/HTTP
exporter (or a given exporter, for tests) and the W3C trace-context propagator. Imported only when a topology
names a collector: opentelemetry is an optional dependency (`tilepd[tracing]`; vLLM installs it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any


def traces_url(endpoint: str) -> str:
    """`http://collector:4318` -> `http://collector:4318/v1/traces`; a URL with a path is used as given."""
    e = endpoint.rstrip("/")
    after_scheme = e.split("://", 1)[-1]
    return e if "/" in after_scheme else e + "/v1/traces"


class TracingUnavailable(RuntimeError):
    """A collector is named but this host cannot export to it (opentelemetry is not installed): the service refuses
    to start rather than run untraced while the operator believes it traced."""


def require_otel(endpoint: str | None, field: str) -> None:
    """Fail at startup, naming the field and the missing package, when `endpoint` is set and the SDK cannot load."""
    if not endpoint:
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(
            f"{field} names an OpenTelemetry collector ({endpoint}) but this host cannot export traces: {exc}; "
            f"install them (pip install 'tilepd[tracing]') or remove {field}") from exc


@dataclass
class OtelExport:
    provider: Any  # opentelemetry.sdk.trace.TracerProvider
    tracer: Any
    propagator: Any  # W3C traceparent / tracestate

    def shutdown(self, log: logging.Logger) -> None:
        """Flush and stop the exporter; a collector's failure never fails the service's stop."""
        try:
            self.provider.shutdown()
        except Exception as exc:  # noqa: BLE001
            log.warning("event=tracing_shutdown_error error=%r", exc)


def otel_export(endpoint: str | None, resource: dict[str, str], tracer_name: str, exporter: Any = None) -> OtelExport:
    """A provider exporting in batches (every 0.5 s, off the request path) to `endpoint` over OTLP/HTTP, or to `exporter`."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint or "http://127.0.0.1:4318"), timeout=5)
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    return OtelExport(provider=provider, tracer=provider.get_tracer(tracer_name), propagator=TraceContextTextMapPropagator())
