"""The request timeline (issue 17): arithmetic, Server-Timing, the router's log line and metrics, OpenTelemetry export.

Fast: the real router app in process, in front of fake upstreams (a vLLM prefill that answers the first token,
a decode node that streams tokens and reports its phases, a native vLLM pair) served by uvicorn on loopback.
The real stack (vLLM + decode node) is tests/router/test_timeline_e2e.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tilepd.connector.launch import free_port
from tilepd.contracts.service_configs import DecodeEndpoint, NativePoolConfig, RouterConfig
from tilepd.router.timeline import Timeline, parse_log_timeline, parse_server_timing

from tests.waiting import wait_until

from .latency_gap import assert_total_is_the_clients

MODEL = "tiny-llama"
CAPS = {"max_seq_len": 1024, "node_api": 2, "sampling": {"temperature": True, "top_p": True, "top_k": True, "seed": True, "stop_token_ids": True,
                                          "ignore_eos": True, "max_tokens": True}}
PREFILL_S = 0.06
NODE = {"wait_ms": 20.0, "queue_ms": 1.0, "convert_ms": 5.0, "inject_ms": 3.0}
STEP_S = 0.01


# -- the arithmetic ------------------------------------------------------------------------------------------------

def test_phases_tile_the_request_and_other_is_the_gap() -> None:
    tl = Timeline("r1", t0=100.0)
    tl.add("admission", 100.0, 100.002)
    tl.add("queue_wait", 100.002, 100.005)
    tl.add("prefill", 100.005, 100.105, node="d0", transfer="tx-1")
    tl.node_stretch(100.105, 100.305, {"wait_ms": 10.0, "queue_ms": 0.5, "convert_ms": 4.0, "inject_ms": 1.5, "decode_ms": 150.0,
                                       "tokens": 30, "tokens_per_s": 200.0, "transfer_ms": 40.0, "first_step_ms": 6.0}, node="d0")
    tl.add("respond", 100.305, 100.306)
    tl.close(100.310)  # 4 ms no phase covers
    ph = tl.phases_ms()
    assert list(ph) == ["admission", "queue_wait", "prefill", "kv_wait", "node_queue", "convert", "inject", "decode", "relay", "respond",
                        "other"]
    assert ph["kv_wait"] == pytest.approx(10.0) and ph["decode"] == pytest.approx(150.0)
    assert ph["relay"] == pytest.approx(200.0 - 166.0)  # the stretch minus what the node reported
    assert ph["other"] == pytest.approx(4.0)
    assert sum(ph.values()) == pytest.approx(tl.total_ms) == pytest.approx(310.0)
    assert tl.details == {"transfer": 40.0, "first_step": 6.0}
    fields = tl.log_fields()
    assert parse_log_timeline(re.search(r"timeline=(\S+)", fields).group(1))["relay"] == pytest.approx(34.0, abs=0.1)
    assert "node_tokens=30 tokens_per_s=200.0" in fields and "detail=transfer:40.0,first_step:6.0" in fields


def test_node_claiming_more_than_the_stretch_is_clipped_and_the_sum_still_holds() -> None:
    tl = Timeline("r2", t0=0.0)
    tl.add("prefill", 0.0, 0.1)
    tl.node_stretch(0.1, 0.15, {"wait_ms": 30.0, "convert_ms": 30.0, "decode_ms": 30.0})  # 90 ms claimed in a 50 ms stretch
    tl.close(0.15)
    ph = tl.phases_ms()
    assert ph["kv_wait"] == pytest.approx(30.0) and ph["convert"] == pytest.approx(20.0) and ph.get("decode", 0.0) == 0.0
    assert ph["relay"] == 0.0 and sum(ph.values()) == pytest.approx(150.0)


def test_no_done_line_makes_the_stretch_the_routers_decode_and_repeats_sum() -> None:
    tl = Timeline("r3", t0=0.0)
    tl.add("prefill", 0.0, 0.1, node="d0")
    tl.add("failed_attempt", 0.1, 0.3, node="d0", cause="silent")
    tl.add("queue_wait", 0.3, 0.31, retry=True)
    tl.add("prefill", 0.31, 0.4, node="d1")
    tl.node_stretch(0.4, 0.5, None, node="d1")
    tl.close(0.5)
    ph = tl.phases_ms()
    assert ph["prefill"] == pytest.approx(190.0) and ph["failed_attempt"] == pytest.approx(200.0)
    assert ph["decode"] == pytest.approx(100.0) and tl.spans[-1].attrs["measured_by"] == "router"
    assert ph["other"] == pytest.approx(0.0, abs=1e-6)


def test_server_timing_is_rfc_syntax_and_round_trips() -> None:
    tl = Timeline("r4", t0=0.0)
    tl.add("admission", 0.0, 0.0012)
    tl.add("prefill", 0.0012, 0.0512)
    tl.attrs["fallback"] = 'unsupported:n "x"'
    partial = tl.server_timing(partial=True)
    assert "total" not in partial and "prefill;dur=50.0" in partial
    tl.close(0.06)
    value = tl.server_timing()
    assert re.fullmatch(r'[a-z_]+;dur=[0-9.]+(, [a-z_]+;dur=[0-9.]+)*, fallback;desc="[^"]*"', value), value
    parsed = parse_server_timing(value)
    assert parsed["total"]["dur"] == pytest.approx(60.0) and parsed["other"]["dur"] == pytest.approx(8.8)
    assert parsed["fallback"]["desc"] == "unsupported:n x"


def test_request_id_is_made_safe_for_log_lines() -> None:
    from tilepd.router.call import request_id

    assert request_id("abc-123_X.y:z") == "abc-123_X.y:z"
    assert request_id("a b=c\nd") == "a_b_c_d"
    assert request_id("x" * 300) == "x" * 128
    assert request_id(None).startswith("req-") and request_id("   ").startswith("req-")


# -- the router in front of fake upstreams -------------------------------------------------------------------------

class Fakes:
    def __init__(self) -> None:
        self.headers: list[tuple[str, dict[str, str]]] = []  # (what, headers) of each upstream call
        self.failed: set[str] = set()


def _fake_prefill(fakes: Fakes) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        fakes.headers.append(("prefill", dict(request.headers)))
        await asyncio.sleep(PREFILL_S)
        n = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 4
        out = {"choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": {"tokens": ["token_id:100"]}}],
               "usage": {"prompt_tokens": n, "completion_tokens": 1}}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            out["kv_transfer_params"] = {"remote_engine_id": "e", "remote_block_ids": [1]}
        return JSONResponse(out)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:  # the native pool's prefill and decode (n=2)
        body = await request.json()
        fakes.headers.append(("native", dict(request.headers)))
        await asyncio.sleep(PREFILL_S)
        out: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion", "model": MODEL,
                               "choices": [{"index": i, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                                           for i in range(body.get("n") or 1)],
                               "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            out["kv_transfer_params"] = {"remote_engine_id": "e", "remote_block_ids": [1]}
        return JSONResponse(out)

    return app


def _fake_node(fakes: Fakes) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/capabilities")
    async def caps() -> dict:
        return CAPS

    @app.get("/status")
    async def status() -> dict:
        return {"busy": False, "transfer_id": None}

    @app.post("/v1/cancel")
    async def cancel(request: Request) -> dict:
        return {"cancelled": False, "transfer_id": (await request.json())["transfer_id"]}

    @app.post("/v1/reserve")
    async def reserve(request: Request) -> dict:
        return {"transfer_id": (await request.json())["transfer_id"], "fence": 1, "lease_s": 10.0}

    @app.post("/v1/renew")
    async def renew(request: Request) -> dict:
        return {"transfer_id": (await request.json())["transfer_id"], "fence": 1, "lease_s": 10.0}

    @app.post("/v1/decode")
    async def decode(request: Request) -> Any:
        body = await request.json()
        fakes.headers.append(("node", dict(request.headers)))
        rid = request.headers.get("x-request-id", "")
        if rid.startswith("fail-once") and rid not in fakes.failed:  # the first try on this node: not ready (retry elsewhere)
            fakes.failed.add(rid)
            await asyncio.sleep(0.02)
            return JSONResponse({"error": {"code": "not_ready", "message": "decode node is starting"}}, status_code=503)
        n = int(body["max_tokens"])
        if not body.get("stream", True):
            return {"tokens": [101], "finish_reason": "length", "completion_tokens": 1, "timings": {}}

        async def lines() -> Any:
            t_arrive = time.perf_counter()
            await asyncio.sleep(sum(NODE.values()) / 1e3)
            t_dec = time.perf_counter()
            for i in range(n):
                await asyncio.sleep(STEP_S)
                yield (json.dumps({"token": 101 + i}) + "\n").encode()
            decode_ms = (time.perf_counter() - t_dec) * 1e3
            timings = {**NODE, "decode_ms": decode_ms, "tokens": n, "tokens_per_s": n / decode_ms * 1e3, "transfer_ms": 12.0,
                       "first_step_ms": STEP_S * 1e3, "node_ms": (time.perf_counter() - t_arrive) * 1e3}
            yield (json.dumps({"done": True, "finish_reason": "length", "completion_tokens": n, "timings": timings}) + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


class _Served:
    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", loop="asyncio"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[Fakes, _Served, _Served]]:
    f = Fakes()
    prefill, node = _Served(_fake_prefill(f)), _Served(_fake_node(f))
    yield f, prefill, node
    node.stop()
    prefill.stop()


def _config(prefill: _Served, node: _Served, **extra: Any) -> RouterConfig:
    return RouterConfig(port=free_port(), served_model_name=MODEL, tokenizer_dir=extra.pop("tokenizer_dir"),
                        prefill_urls=(prefill.url,),
                        decode_nodes=(DecodeEndpoint(name="d0", host="127.0.0.1", ctrl_port=free_port(), http_port=node.port),),
                        native_pool=NativePoolConfig(prefill_urls=(prefill.url,), decode_urls=(prefill.url,)), **extra)


@pytest.fixture()
def router(tiny_llama: Path, fakes: tuple[Fakes, _Served, _Served], caplog: pytest.LogCaptureFixture) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from tilepd.router.app import create_app
    from tilepd.router.auth import ApiKeys

    _, prefill, node = fakes
    app = create_app(_config(prefill, node, tokenizer_dir=tiny_llama), ApiKeys(keys=()))
    caplog.set_level("INFO", logger="tilepd.router")
    with TestClient(app) as client:
        yield client


def _done_line(caplog: pytest.LogCaptureFixture, rid: str) -> str:
    lines = [r.getMessage() for r in caplog.records if f"req={rid} event=done" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


def _timed(router: Any, path: str, body: dict[str, Any], rid: str) -> tuple[Any, tuple[float, float]]:
    """One request through the in-process client: the response and (the router's total, the client's latency) in ms.
    In process, the client's time also holds the test client's thread hops, hence the 30 ms floor where it is used."""
    t = time.perf_counter()
    r = router.post(path, json=body, headers={"x-request-id": rid})
    client_ms = (time.perf_counter() - t) * 1e3
    assert r.status_code == 200, r.text
    return r, (parse_server_timing(r.headers["server-timing"])["total"]["dur"], client_ms)


def test_a_request_shows_every_phase_adding_up_to_the_clients_latency(router: Any, caplog: pytest.LogCaptureFixture) -> None:
    n = 20
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": n + 1, "temperature": 0}
    r, pair = _timed(router, "/v1/completions", body, "tl-1")
    st = parse_server_timing(r.headers["server-timing"])
    for phase in ("admission", "queue_wait", "prefill", "kv_wait", "node_queue", "convert", "inject", "decode", "relay", "respond", "total"):
        assert phase in st, (phase, r.headers["server-timing"])
    parts = sum(v["dur"] for k, v in st.items() if k != "total")
    assert parts == pytest.approx(st["total"]["dur"], abs=0.5)
    extra = itertools.count(4)
    assert_total_is_the_clients([pair] + [_timed(router, "/v1/completions", body, f"tl-1.{i}")[1] for i in range(4)], floor_ms=30.0,
                                more=lambda: _timed(router, "/v1/completions", body, f"tl-1.{next(extra)}")[1], up_to=5)
    assert st["prefill"]["dur"] >= PREFILL_S * 1e3 and st["kv_wait"]["dur"] == pytest.approx(NODE["wait_ms"], abs=0.2)
    assert st["decode"]["dur"] >= n * STEP_S * 1e3
    line = _done_line(caplog, "tl-1")
    phases = parse_log_timeline(re.search(r" timeline=(\S+)", line).group(1))
    assert sum(phases.values()) == pytest.approx(float(re.search(r" ms=([0-9.]+)", line).group(1)), abs=1.0)
    assert re.search(r" transfers=tx-[0-9a-f]+ ", line) and f"node_tokens={n}" in line and "detail=transfer:12.0" in line
    metrics = router.get("/metrics").text
    assert 'tilepd_router_phase_seconds_count{phase="decode",route="low_latency"}' in metrics
    assert 'tilepd_router_phase_seconds_count{phase="prefill",route="low_latency"}' in metrics


def test_a_stream_carries_the_phases_up_to_the_first_token_and_logs_all(router: Any, caplog: pytest.LogCaptureFixture) -> None:
    with router.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True},
                       headers={"x-request-id": "tl-2"}) as r:
        st = parse_server_timing(r.headers["server-timing"])
        body = b"".join(r.iter_bytes())
    assert body.endswith(b"data: [DONE]\n\n")
    assert set(st) == {"admission", "queue_wait", "prefill"}
    phases = parse_log_timeline(re.search(r" timeline=(\S+)", _done_line(caplog, "tl-2")).group(1))
    assert phases["decode"] > 0 and phases["kv_wait"] == pytest.approx(NODE["wait_ms"], abs=0.2)


def test_a_streams_total_ends_when_its_last_bytes_leave(tiny_llama: Path, fakes: tuple[Fakes, _Served, _Served],
                                                         caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `[DONE]` chunk ends the HTTP body, and the stream's `finally` (settle, log line) runs only when the server asks
    for more. A fake delay there (150 ms of blocking in settle_soon: an injected fault, standing in for a loaded box)
    must not count: the router's total is never more than what the client measured over real sockets."""
    import httpx

    from tilepd.router.app import create_app
    from tilepd.router.auth import ApiKeys
    from tilepd.router.lowlatency import LowLatencyRun

    real_settle = LowLatencyRun.settle_soon

    def slow_settle(self: LowLatencyRun) -> None:
        time.sleep(0.15)
        real_settle(self)

    monkeypatch.setattr(LowLatencyRun, "settle_soon", slow_settle)
    _, prefill, node = fakes
    caplog.set_level("INFO", logger="tilepd.router")
    served = _Served(create_app(_config(prefill, node, tokenizer_dir=tiny_llama), ApiKeys(keys=())))
    try:
        with httpx.Client(timeout=30) as client:
            assert wait_until(lambda: client.get(served.url + "/health").status_code == 200, 10.0)
            for i in range(3):
                rid = f"tl-end-{i}"
                t = time.perf_counter()
                with client.stream("POST", served.url + "/v1/completions", headers={"x-request-id": rid},
                                   json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}) as r:
                    body = b"".join(r.iter_bytes())
                client_ms = (time.perf_counter() - t) * 1e3
                assert body.endswith(b"data: [DONE]\n\n")
                assert wait_until(lambda: any(f"req={rid} event=done" in x.getMessage() for x in caplog.records), 5.0)
                server_ms = float(re.search(r" ms=([0-9.]+)", _done_line(caplog, rid)).group(1))
                assert server_ms <= client_ms + 0.1, (server_ms, client_ms)  # the log rounds to 0.1 ms
    finally:
        served.stop()


def test_a_forced_fallback_shows_its_reason(router: Any, caplog: pytest.LogCaptureFixture) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3}
    r, pair = _timed(router, "/v1/chat/completions", body, "tl-3")
    assert r.headers["x-tilepd-route"] == "native" and r.headers["x-tilepd-route-reason"] == "unsupported:n"
    st = parse_server_timing(r.headers["server-timing"])
    assert st["fallback"]["desc"] == "unsupported:n"
    assert {"admission", "native_prefill", "native_decode", "total"} <= set(st)
    extra = itertools.count(2)
    assert_total_is_the_clients([pair] + [_timed(router, "/v1/chat/completions", body, f"tl-3.{i}")[1] for i in range(2)],
                                floor_ms=30.0, more=lambda: _timed(router, "/v1/chat/completions", body, f"tl-3.{next(extra)}")[1], up_to=5)
    line = _done_line(caplog, "tl-3")
    assert "route=native reason=unsupported:n" in line and "fallback=unsupported:n" in line


def test_a_retry_shows_its_node_cause_and_time(router: Any, caplog: pytest.LogCaptureFixture) -> None:
    r = router.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, headers={"x-request-id": "fail-once-1"})
    assert r.status_code == 200, r.text
    st = parse_server_timing(r.headers["server-timing"])
    assert st["failed_attempt"]["dur"] >= 20 and st["failed_attempt"]["desc"] == "d0 not_ready"
    assert st["prefill"]["dur"] >= 2 * PREFILL_S * 1e3  # the prefill ran again for the second try
    line = _done_line(caplog, "fail-once-1")
    assert "retries=d0:not_ready " in line and "failovers=1" in line and len(re.search(r" transfers=(\S+)", line).group(1).split(",")) == 2
    phases = parse_log_timeline(re.search(r" timeline=(\S+)", line).group(1))
    assert phases["other"] == pytest.approx(0.0, abs=0.2) and phases["queue_wait"] >= 0


def test_traceparent_goes_down_and_the_spans_reach_an_otlp_receiver(tiny_llama: Path, fakes: tuple[Fakes, _Served, _Served]) -> None:
    """A real OTLP/HTTP receiver (a tiny HTTP server in this test that accepts POST /v1/traces protobuf)."""
    from fastapi.testclient import TestClient
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tilepd.router.app import create_app
    from tilepd.router.auth import ApiKeys

    got: list[ExportTraceServiceRequest] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            raw = self.rfile.read(int(self.headers["content-length"]))
            if self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf":
                req = ExportTraceServiceRequest()
                req.ParseFromString(raw)
                got.append(req)
                self.send_response(200)
            else:
                self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    collector = ThreadingHTTPServer(("127.0.0.1", free_port()), Receiver)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    f, prefill, node = fakes
    try:
        cfg = _config(prefill, node, tokenizer_dir=tiny_llama, otlp_endpoint=f"http://127.0.0.1:{collector.server_address[1]}")
        client_trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        f.headers.clear()
        with TestClient(create_app(cfg, ApiKeys(keys=()))) as client:
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                            headers={"x-request-id": "tl-otel", "traceparent": client_trace})
            assert r.status_code == 200
        # the router's shutdown flushed the batch processor
    finally:
        collector.shutdown()
    spans = [s for req in got for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    by_name = {s.name: s for s in spans}
    root = by_name["POST /v1/completions"]
    assert root.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c" and root.parent_span_id.hex() == "b7ad6b7169203331"
    for phase in ("admission", "queue_wait", "prefill", "relay", "respond"):
        assert by_name[phase].parent_span_id == root.span_id, phase
    group = by_name["tilepd.decode_node"]
    for phase in ("kv_wait", "convert", "inject", "decode"):
        assert by_name[phase].parent_span_id == group.span_id, phase
    assert all(s.trace_id == root.trace_id for s in spans)
    assert root.end_time_unix_nano - root.start_time_unix_nano > PREFILL_S * 1e9
    down = {what: h.get("traceparent", "") for what, h in f.headers}
    assert down["prefill"].startswith("00-0af7651916cd43dd8448eb211c80319c-" + root.span_id.hex())
    assert down["node"] == down["prefill"]


def test_the_topology_names_the_collector_and_the_plan_gives_it_to_the_router(repo_root: Path, tmp_path: Path) -> None:
    from tilepd.plan import build_plan
    from tilepd.topology import TopologyError, load_topology

    text = (repo_root / "topology_examples" / "local.yaml").read_text()
    assert "  port: 18000\n" in text
    path = tmp_path / "t.yaml"
    path.write_text(text.replace("  port: 18000\n", "  port: 18000\n  otlp_endpoint: http://127.0.0.1:4318\n", 1))
    plan = build_plan(load_topology(path))
    (router_cfg,) = [s.config for h in plan.hosts for s in h.services if s.role == "router"]
    assert router_cfg["otlp_endpoint"] == "http://127.0.0.1:4318"
    decode = [s.config["otlp_endpoint"] for h in plan.hosts for s in h.services if s.role == "decode"]
    assert decode and set(decode) == {"http://127.0.0.1:4318"}  # each node exports its own phases into the same trace
    prefill_argv = [" ".join(s.argv) for h in plan.hosts for s in h.services if s.role == "prefill"]
    assert prefill_argv and all('"otlp_endpoint":"http://127.0.0.1:4318"' in a.replace(" ", "") for a in prefill_argv)  # the connector's spans
    path.write_text(text.replace("  port: 18000\n", "  port: 18000\n  otlp_endpoint: collector:4318\n", 1))
    with pytest.raises(TopologyError, match="otlp_endpoint"):
        load_topology(path)
    plain = build_plan(load_topology(repo_root / "topology_examples" / "local.yaml"))
    assert [s.config["otlp_endpoint"] for h in plain.hosts for s in h.services if s.role == "router"] == [None]


def test_traces_url() -> None:
    from tilepd.otel import traces_url

    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"


# Without opentelemetry installed a service cannot export: it must refuse to start, naming the field, not run
# untraced. The SDK is installed here, so the child hides it with an import blocker (a fault injected on purpose).
_HIDE_OTEL = """
import sys
class _NoOtel:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoOtel())
sys.argv = sys.argv[1:]
"""


def _run_without_otel(module_main: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    code = _HIDE_OTEL + f"from {module_main} import main\nsys.exit(main())\n"
    return subprocess.run([sys.executable, "-c", code, "x", *args], capture_output=True, text=True, timeout=120)


def test_a_collector_named_without_opentelemetry_installed_is_refused_by_name(tiny_llama: Path, tmp_path: Path) -> None:
    from tilepd.contracts.exit_codes import ExitCode
    from tilepd.contracts.service_configs import DecodeServerConfig, TransportConfig

    cfg = RouterConfig(port=free_port(), served_model_name=MODEL, tokenizer_dir=tiny_llama, prefill_urls=("http://127.0.0.1:9",),
                       decode_nodes=(DecodeEndpoint(name="d0", host="127.0.0.1", ctrl_port=free_port(), http_port=free_port()),),
                       otlp_endpoint="http://127.0.0.1:4318")
    (tmp_path / "router.json").write_text(cfg.model_dump_json())
    r = _run_without_otel("tilepd.router.__main__", ["--config", str(tmp_path / "router.json")])
    assert r.returncode == ExitCode.NOT_AVAILABLE, r.stderr
    assert "router.otlp_endpoint" in r.stderr and "http://127.0.0.1:4318" in r.stderr and "opentelemetry" in r.stderr, r.stderr
    assert "tilepd[tracing]" in r.stderr and "Traceback" not in r.stderr

    node = DecodeServerConfig(name="d0", served_model_name=MODEL, family="llama", weights_dir=tmp_path / "no-weights-needed",
                              max_seq_len=512, advertise_host="127.0.0.1", ctrl_port=free_port(), http_port=free_port(),
                              transport=TransportConfig(name="tcp"), otlp_endpoint="http://127.0.0.1:4318")
    (tmp_path / "node.json").write_text(node.model_dump_json())
    r = _run_without_otel("tilepd.runtime.__main__", ["--config", str(tmp_path / "node.json")])
    assert r.returncode == ExitCode.NOT_AVAILABLE, r.stderr
    assert "router.otlp_endpoint" in r.stderr and "tilepd[tracing]" in r.stderr and "Traceback" not in r.stderr
