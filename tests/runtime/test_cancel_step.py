"""/v1/cancel stops a decode within one engine step.

Uses the TEST-ONLY HF engine with a fixed delay per step, in-process behind a real
uvicorn server and real sockets, so "within one step" can be asserted from token
counts instead of timing: after the cancel call returns, at most one more token
may be produced (the step that was already running).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.runtime.conftest import wire_payload
from tests.runtime.hf_engine import hf_prefill_kv
from tests.runtime.inprocess_node import inprocess_node
from tilepd.control.cache_layout import CacheLayout
from tilepd.control.sender import KVSender
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig
from tilepd.engine.types import DecodeEngine
from tilepd.transport import Buffer


@pytest.fixture(scope="module")
def slow_node(tiny_llama):
    with inprocess_node(tiny_llama, step_delay_s=0.05, name="slow") as node:
        assert isinstance(node[1], DecodeEngine)
        yield node


def test_cancel_within_one_step(slow_node) -> None:
    svc, eng, base = slow_node
    c = eng.config
    layout = CacheLayout(kind="attn", num_layers=c.num_layers, block_size=16, num_heads=c.num_kv_heads, entry_width=2 * c.head_dim,
                         dtype="float32", head_size_k=c.head_dim, head_size_v=c.head_dim)
    prompt = [3, 14, 15, 92, 65]
    first, layers = hf_prefill_kv(eng.model, prompt)
    staging = wire_payload(layers, layout)
    ecfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=svc.ctrl.port, http_port=1),),
                                transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=512)
    sender = KVSender(ecfg, layout, Buffer.from_array(staging))
    fence = svc.slot.reserve("tx-c", "tok").reservation.fence
    assert sender.send(("127.0.0.1", svc.ctrl.port), "tx-c", "tok", len(prompt), 1, [0, layout.block_bytes]).ok
    sender.close()
    tokens_at_cancel = None
    lines = []
    body = {"transfer_id": "tx-c", "token": "tok", "fence": fence, "first_token": first, "prompt_tokens": len(prompt), "max_tokens": 200,
            "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=30) as cl, cl.stream("POST", "/v1/decode", json=body) as r:
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(json.loads(line))
            if len(lines) == 4:
                with httpx.Client(base_url=base) as c2:
                    assert c2.post("/v1/cancel", json={"transfer_id": "tx-c"}).json()["cancelled"]
                tokens_at_cancel = eng.produced  # read after the cancel call returned
    last = lines[-1]
    assert last["finish_reason"] == "cancelled"
    # tokens generated when the cancel returned + at most the one step that was running
    assert last["completion_tokens"] <= tokens_at_cancel + 1
    assert svc.slot.snapshot()["state"] == "free"


def _land_prompt_kv(svc, eng, prompt: list[int], transfer_id: str) -> tuple[int, int]:
    """Reserve the slot, send HF's prefill KV of `prompt` to the node over tcp, as the connector would; returns the first
    token and the reservation's fence."""
    c = eng.config
    layout = CacheLayout(kind="attn", num_layers=c.num_layers, block_size=16, num_heads=c.num_kv_heads, entry_width=2 * c.head_dim,
                         dtype="float32", head_size_k=c.head_dim, head_size_v=c.head_dim)
    first, layers = hf_prefill_kv(eng.model, prompt)
    ecfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=svc.ctrl.port, http_port=1),),
                                transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=512)
    sender = KVSender(ecfg, layout, Buffer.from_array(wire_payload(layers, layout)))
    fence = svc.slot.reserve(transfer_id, "tok").reservation.fence
    assert sender.send(("127.0.0.1", svc.ctrl.port), transfer_id, "tok", len(prompt), 1, [0, layout.block_bytes]).ok
    sender.close()
    return first, fence


def test_done_line_reports_the_node_phases(slow_node, caplog) -> None:
    """The final `timings` carry the node's phases in order (the router's timeline places them; INTERFACES §4)."""
    svc, eng, base = slow_node
    prompt = [3, 14, 15, 92, 65]
    first, fence = _land_prompt_kv(svc, eng, prompt, "tx-t")
    caplog.set_level("INFO", logger="tilepd.runtime.http")
    body = {"transfer_id": "tx-t", "token": "tok", "fence": fence, "first_token": first, "prompt_tokens": len(prompt), "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=30) as cl:
        lines = [json.loads(x) for x in cl.post("/v1/decode", json=body, headers={"x-request-id": "req-t1"}).text.splitlines() if x]
    t = lines[-1]["timings"]
    for key in ("wait_ms", "queue_ms", "convert_ms", "inject_ms", "decode_ms", "transfer_ms", "node_ms", "first_step_ms", "tokens_per_s"):
        assert isinstance(t[key], float) and t[key] >= 0, key
    assert t["tokens"] == 4 and t["decode_ms"] >= 4 * 50 * 0.9
    assert t["node_ms"] >= t["wait_ms"] + t["queue_ms"] + t["convert_ms"] + t["inject_ms"] + t["decode_ms"] - 0.5
    done = [r.getMessage() for r in caplog.records if "event=decode_done transfer_id=tx-t " in r.getMessage()]
    assert len(done) == 1 and " req=req-t1 " in done[0] and " transfer_ms=" in done[0]


def test_node_exports_its_phases_into_the_callers_trace(slow_node) -> None:
    """With a traceparent, the node's phases become spans under it. Exporter: the OpenTelemetry SDK's
    InMemorySpanExporter (this test's stand-in for a collector; the router's OTLP/HTTP export to a real receiver
    is tested in tests/router/test_timeline.py and test_timeline_e2e.py)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tilepd.runtime.tracing import NodeTracing

    svc, eng, base = slow_node
    memory = InMemorySpanExporter()
    svc.tracing = NodeTracing(None, "slow", exporter=memory)
    try:
        prompt = [3, 14, 15, 92, 65]
        first, fence = _land_prompt_kv(svc, eng, prompt, "tx-o")
        parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        body = {"transfer_id": "tx-o", "token": "tok", "fence": fence, "first_token": first, "prompt_tokens": len(prompt), "max_tokens": 3,
                "ignore_eos": True}
        with httpx.Client(base_url=base, timeout=30) as cl:
            lines = [json.loads(x) for x in cl.post("/v1/decode", json=body, headers={"traceparent": parent}).text.splitlines() if x]
        assert lines[-1]["timings"]["traced"] == 1
        svc.tracing.provider.force_flush()
        spans = {s.name: s for s in memory.get_finished_spans()}
        group = spans["tilepd.decode_node"]
        assert format(group.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert format(group.parent.span_id, "016x") == "00f067aa0ba902b7"
        for name in ("kv_wait", "convert", "inject", "decode"):
            assert spans[name].parent.span_id == group.context.span_id, name
        assert spans["decode"].attributes["tilepd.tokens"] == 3
        assert dict(group.resource.attributes)["service.name"] == "tilepd-decode"
    finally:
        svc.tracing.shutdown()
        svc.tracing = None


def test_a_stream_whose_client_went_away_still_logs_its_decode_done(slow_node, caplog) -> None:
    """The client closes its stream mid-decode: the engine stops at its next step and the node still logs the request's
    `event=decode_done` (finish=cancelled) and counts it, as it does for every other decode."""
    svc, eng, base = slow_node
    prompt = [3, 14, 15, 92, 65]
    first, fence = _land_prompt_kv(svc, eng, prompt, "tx-gone")
    caplog.set_level("INFO", logger="tilepd.runtime.http")
    cancelled_before = svc.metrics.requests.labels("cancelled")._value.get()
    body = {"transfer_id": "tx-gone", "token": "tok", "fence": fence, "first_token": first, "prompt_tokens": len(prompt),
            "max_tokens": 200, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=30) as cl, cl.stream("POST", "/v1/decode", json=body, headers={"x-request-id": "req-gone"}) as r:
        for n, line in enumerate(r.iter_lines()):
            if line and n >= 2:
                break  # leaving the block closes the connection mid-stream

    def done_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "event=decode_done transfer_id=tx-gone " in r.getMessage()]

    deadline = time.monotonic() + 20
    while not done_lines() and time.monotonic() < deadline:
        time.sleep(0.05)
    (done,) = done_lines()
    assert " req=req-gone " in done and " finish=cancelled " in done
    assert svc.metrics.requests.labels("cancelled")._value.get() == cancelled_before + 1
    assert any("event=client_gone transfer_id=tx-gone req=req-gone" in r.getMessage() for r in caplog.records)
