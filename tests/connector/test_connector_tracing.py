"""The connector's hand-off spans (tilepd/connector/tracing.py): the router's traceparent, read beside the marker,
parents a `tilepd.connector` span with `kv_stage` and `kv_send` at the times the worker measured."""

from __future__ import annotations

import time

import pytest

from tilepd.connector.tracing import TRACEPARENT_KEY, ConnectorTracing, make_connector_tracing, traceparent_of

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_traceparent_is_read_beside_the_marker_and_only_when_well_formed() -> None:
    assert traceparent_of({"tilepd": {}, TRACEPARENT_KEY: TP}) == TP
    for bad in (None, "x", TP.upper(), TP + "-00", 42, "00-" + "0" * 31 + "-b7ad6b7169203331-01"):
        assert traceparent_of({TRACEPARENT_KEY: bad}) is None
    assert traceparent_of(None) is None and traceparent_of(["x"]) is None
    assert make_connector_tracing(None) is None


def test_handoff_spans_sit_under_the_routers_span_in_order() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing = ConnectorTracing(None, exporter=exporter)
    t0 = time.perf_counter()
    tracing.handoff(TP, t_stage=t0, t_staged=t0 + 0.010, t_send=t0 + 0.012, t_end=t0 + 0.020, ok=False,
                    attrs={"transfer_id": "tx-1", "bytes": 4096, "wire_ms": None, "code": "busy"})
    tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"tilepd.connector", "kv_stage", "kv_send"}
    group = spans["tilepd.connector"]
    assert f"{group.context.trace_id:032x}" == TP.split("-")[1] and f"{group.parent.span_id:016x}" == TP.split("-")[2]
    for name in ("kv_stage", "kv_send"):
        assert spans[name].parent.span_id == group.context.span_id
    assert (spans["kv_stage"].end_time - spans["kv_stage"].start_time) / 1e6 == pytest.approx(10.0, abs=0.01)
    assert (spans["kv_send"].end_time - spans["kv_send"].start_time) / 1e6 == pytest.approx(8.0, abs=0.01)
    assert group.start_time == spans["kv_stage"].start_time and group.end_time == spans["kv_send"].end_time
    assert group.attributes["tilepd.transfer_id"] == "tx-1" and "tilepd.wire_ms" not in group.attributes
    assert not group.status.is_ok and group.status.description == "busy"
