"""The router's HTTP surface: OpenAI endpoints, health, metrics, status.

Request path (low-latency pool): authenticate -> validate -> route -> capability gate
-> render the prompt -> lease a node -> prefill + decode (lowlatency.py) -> SSE or
JSON. Anything the low-latency pool cannot take goes to the native pool when the
config allows it, else fails with a typed error; the response headers always say
which pool served it and why (`x-tilepd-route`, `x-tilepd-route-reason`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from tilepd.auth import load_secret, vllm_auth_header
from tilepd.contracts.service_configs import RouterConfig
from tilepd.router.auth import ApiKeys
from tilepd.router.backends import DecodeNodeError, cancel_decode
from tilepd.router.errors import PassThroughError, RouterError, invalid, unsupported
from tilepd.router.gate import gate
from tilepd.router.health import probe_all, probe_forever
from tilepd.router.leases import LeaseTimeout, NodePool, NoNodeInRotation
from tilepd.router.limits import BodySizeLimit
from tilepd.router.logprobs import LogprobsRenderer
from tilepd.router.structured import structured_plan
from tilepd.router.tools import ToolCalling, ToolPlan, Unsupported
from tilepd.router.lowlatency import EnginePlan, Finished, HandoffRefused, LowLatencyRun, TextDelta
from tilepd.router.metrics import RouterMetrics
from tilepd.router.native import serve_native
from tilepd.router.prompts import PromptRenderer, refuse_client_template
from tilepd.router.reasons import bounded_reason
from tilepd.router.protocol import ChatCompletionRequest, CompletionRequest, Endpoint
from tilepd.router.responses import DONE, EventStreamResponse, ResponseWriter, error_chunk
from tilepd.router.routing import Route, choose_route, served_models
from tilepd.router.state import RouterState
from tilepd.router.timeline import Timeline
from tilepd.router.tracing import make_tracing
from tilepd.router.upstream import Upstream

log = logging.getLogger("tilepd.router")
RETRY_AFTER_S = 1


class _Fallback(Exception):
    """The low-latency pool cannot take the request; `error` is what the client gets without a native pool."""

    def __init__(self, reason: str, error: RouterError) -> None:
        super().__init__(reason)
        self.reason = bounded_reason(reason)  # a label, a header and a log field: never the client's raw key
        self.error = error


UPSTREAM_CONNECT_RETRIES = 2


def build_state(config: RouterConfig, keys: ApiKeys) -> RouterState:
    pool = NodePool.of(config.decode_nodes)
    # Only the TCP connect is retried (a request is never sent twice), so a connect that timed out
    # while a 2-core host was saturated no longer fails the request outright (seen: native decode
    # connects timing out during a burst fallback on the CPU test box).
    secret = load_secret(config.secret_file) if config.secret_file else None
    vllm_urls = [*config.prefill_urls, *((config.native_pool.prefill_urls + config.native_pool.decode_urls) if config.native_pool else ())]
    client = Upstream(connect_timeout_s=5.0, read_timeout_s=config.request_timeout_s, connect_retries=UPSTREAM_CONNECT_RETRIES,
                      auth_by_base_url={u: vllm_auth_header(secret) for u in vllm_urls})  # every vLLM requires its key
    renderer = PromptRenderer(config.tokenizer_dir)
    if config.tool_call_parser:  # vLLM (and torch) load here, at startup, not on the first tool request
        renderer.tools = ToolCalling(config.tool_call_parser, renderer.tokenizer, config.served_model_name)
    renderer.start_pool(config.prompt_render)  # forked with all of that loaded
    return RouterState(config=config, client=client, renderer=renderer, pool=pool,
                       metrics=RouterMetrics(pool, config.breaker_failures), keys=keys,
                       node_secret=secret,
                       tracing=make_tracing(config.otlp_endpoint))


def create_app(config: RouterConfig, keys: ApiKeys) -> FastAPI:
    """The ASGI app; tokenizer loading happens here so a bad tokenizer_dir fails at startup."""
    state = build_state(config, keys)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        lag_watch = asyncio.get_running_loop().create_task(state.loop_lag.run())
        await probe_all(state)
        log.info("event=started nodes_in_rotation=%d/%d native_pool=%s auth=%s", len(state.pool.in_rotation()),
                 len(state.pool.nodes), config.native_pool is not None, "open" if keys.open else "bearer")
        prober = asyncio.get_running_loop().create_task(probe_forever(state, config.health_interval_s))
        try:
            yield
        finally:
            prober.cancel()
            lag_watch.cancel()
            await _shutdown(state)

    app = FastAPI(title="tilepd router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = state
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(PassThroughError)
    async def _pass_through(_: Request, exc: PassThroughError) -> Response:
        return Response(exc.body, status_code=exc.status, media_type=exc.content_type, headers=exc.headers)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "nodes_in_rotation": len(state.pool.in_rotation()), "nodes": len(state.pool.nodes),
                "native_pool": config.native_pool is not None}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        keys.check(request.headers.get("authorization"))
        return {"queue_depth": state.pool.queue_depth, "nodes": [
            {"name": n.name, "url": n.base_url, "in_rotation": n.in_rotation, "leased": n.leased, "transfer_id": n.transfer_id,
             "consecutive_failures": n.consecutive_failures, "last_error": n.last_error, "leases_total": n.leases_total}
            for n in state.pool.nodes]}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        keys.check(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "tilepd"} for m in served_models(config)]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(state, request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(state, request, "chat")

    return app


def request_id(given: str | None) -> str:
    """The client's x-request-id made safe for log lines and headers (printable, no spaces or `=`, at most 128), else a fresh one."""
    if given:
        safe = "".join(ch if (ch.isalnum() or ch in "-_.:/+@") and ord(ch) < 128 else "_" for ch in given.strip())[:128]
        if safe:
            return safe
    return f"req-{uuid.uuid4().hex[:16]}"


async def _handle(state: RouterState, request: Request, endpoint: Endpoint) -> Response:
    t0 = time.perf_counter()
    rid = request_id(request.headers.get("x-request-id"))
    tl = Timeline(rid, t0)
    tl.attrs["endpoint"] = endpoint
    if state.tracing is not None:
        state.tracing.start(tl, request.headers, f"POST {request.url.path}")
    try:
        state.keys.check(request.headers.get("authorization"))
        body = await _read_json(request)
        req = _validate(endpoint, body)
        if endpoint == "chat":  # before any pool: the native vLLM would render a client's template too
            refuse_client_template(body, state.config.prompt_render.allowed_template_kwargs)
        route = choose_route(state.config, req.model, request.headers)
    except RouterError as exc:  # refused before any pool: say so, with the request id, like every other answer
        exc.headers.update({"x-tilepd-route": "none", "x-tilepd-route-reason": exc.code or "refused", "x-request-id": rid})
        tl.upto("admission")
        _close_timeline(state, tl, Route("none", exc.code or "refused"), exc.status)
        log.info("req=%s event=refused status=%d code=%s %s", rid, exc.status, exc.code, tl.log_fields())
        raise
    if route.pool == "low_latency":
        try:
            return await _serve_low_latency(state, request, endpoint, req, body, route, rid, t0, tl)
        except _Fallback as fb:
            if not tl.spans:
                tl.upto("admission")
            tl.attrs["fallback"] = fb.reason
            if state.config.native_pool is None or not state.config.routing.fallback_to_native:
                _count(state, Route("low_latency", fb.reason), fb.error.status, t0)
                _close_timeline(state, tl, Route("low_latency", fb.reason), fb.error.status)
                log.info("req=%s event=refused route=low_latency reason=%s status=%d runbook=%s %s", rid, fb.reason, fb.error.status,
                         fb.error.runbook or "-", tl.log_fields())
                fb.error.headers.update(_route_headers(Route("low_latency", fb.reason), rid))
                fb.error.headers["server-timing"] = tl.server_timing()
                raise fb.error from None
            route = Route("native", fb.reason)
    return await _serve_native(state, endpoint, body, route, rid, t0, tl)


MAX_JSON_DEPTH = 32  # nesting of objects/arrays in a request body (deeper bodies would recurse in copies and validators)


async def _read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RouterError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:
        raise RouterError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise RouterError(400, "request body must be a JSON object", code="invalid_json")
    where = _too_deep(body)
    if where is not None:
        raise RouterError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels at '{where}'", code="invalid_json", param=where)
    return body


def _too_deep(body: dict[str, Any]) -> str | None:
    """The path of the first value nested deeper than MAX_JSON_DEPTH, or None (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in items:
            if isinstance(child, (dict, list)):
                child_path = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"
                if depth + 1 > MAX_JSON_DEPTH:
                    return child_path.lstrip(".")
                stack.append((child, child_path, depth + 1))
    return None


def _validate(endpoint: Endpoint, body: dict[str, Any]) -> CompletionRequest | ChatCompletionRequest:
    model = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        raise invalid(param, first["msg"]) from None


def _route_headers(route: Route, rid: str) -> dict[str, str]:
    return {"x-tilepd-route": route.pool, "x-tilepd-route-reason": route.reason, "x-request-id": rid}


def _close_timeline(state: RouterState, tl: Timeline, route: Route, status: int, t_end: float | None = None) -> None:
    """End the request's timeline: `respond` up to `t_end` (default now), the phase histograms, the trace. A stream
    ends when its last bytes were handed to the server: the generator's `finally` runs only once the server asks for
    more, after the client may already have them all."""
    if tl.t_end is not None:
        return
    if tl.spans:
        tl.upto("respond", end=t_end)
    tl.close(t_end)
    tl.attrs.setdefault("route", route.pool)
    tl.attrs.setdefault("reason", route.reason)
    hist = state.metrics.phase_seconds
    for phase, ms in tl.phases_ms().items():
        if ms > 0 and (phase != "other" or ms >= 0.05):
            hist.labels(phase, route.pool).observe(ms / 1e3)
    if state.tracing is not None:
        try:
            state.tracing.finish(tl, status)
        except Exception as exc:  # noqa: BLE001 - tracing never fails a request
            log.warning("req=%s event=tracing_error error=%r", tl.request_id, exc)


def _count(state: RouterState, route: Route, status: int, t0: float) -> None:
    m = state.metrics
    m.routes.labels(route.pool, route.reason).inc()
    m.responses.labels(route.pool, str(status)).inc()
    m.request_seconds.labels(route.pool).observe(time.perf_counter() - t0)


async def _plan(state: RouterState, endpoint: Endpoint, req: CompletionRequest | ChatCompletionRequest, max_seq_len: int,
                rid: str, tools: ToolPlan | None = None) -> EnginePlan:
    renderer = state.renderer
    if isinstance(req, ChatCompletionRequest):
        prompt_ids = await renderer.chat_ids(req, rid, tools.tool_dicts if tools is not None else None)
        limit, limit_name = req.token_limit(), ("max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    else:
        prompt_ids = await renderer.completion_ids(req, rid)
        limit, limit_name = req.max_tokens, "max_tokens"
    if limit is not None and limit < 1:
        raise invalid(limit_name, "must be at least 1")
    room = max_seq_len - len(prompt_ids)
    if room < 1 or (limit is not None and limit > room):
        raise _Fallback("context_length", RouterError(
            400, f"prompt ({len(prompt_ids)} tokens) + {limit_name} ({limit}) exceed the low-latency pool's "
            f"max_seq_len {max_seq_len}", code="context_length_exceeded", param=limit_name))
    defaults = renderer.generation_defaults
    top_k = req.top_k if req.top_k is not None else int(defaults.get("top_k", 0))
    return EnginePlan(
        prompt_ids=prompt_ids,
        max_tokens=limit if limit is not None else room,
        temperature=req.temperature if req.temperature is not None else float(defaults.get("temperature", 1.0)),
        top_p=req.top_p if req.top_p is not None else float(defaults.get("top_p", 1.0)),
        top_k=max(top_k, 0),
        seed=req.seed,
        stop=req.stop_strings(),
        include_stop_str_in_output=req.include_stop_str_in_output,
        stop_token_ids=list(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        skip_special_tokens=tools.skip_special_tokens if tools is not None else req.skip_special_tokens,
        logprobs=wanted_logprobs(req),
        structured=_structured(req, tools),
    )


def _structured(req: CompletionRequest | ChatCompletionRequest, tools: ToolPlan | None) -> Any:
    """The tool parser's constraint when it set one (vLLM drops response_format then), else the client's
    response_format / structured_outputs (the gate sent structured_outputs with tools native)."""
    if tools is not None and tools.structured is not None:
        return tools.structured
    return structured_plan(req)


def _tool_plan(state: RouterState, req: CompletionRequest | ChatCompletionRequest, body: dict[str, Any],
               caps: dict[str, Any]) -> ToolPlan | None:
    """vLLM's parser's view of a request with tools; None without tools. The node must compile the constraint
    the parser built (an older node without that kind sends the request to the native pool)."""
    if not isinstance(req, ChatCompletionRequest) or not (req.tools or req.tool_choice not in (None, "none")):
        return None
    try:
        tools = state.renderer.tools.plan(body)
    except Unsupported as exc:
        raise _Fallback(f"unsupported:{exc.param}", unsupported(exc.param, exc.reason)) from None
    kind = tools.structured.node["type"] if tools.structured is not None else None
    if kind is not None and kind not in ((caps.get("sampling") or {}).get("structured_output") or ()):
        raise _Fallback("unsupported:tool_choice", unsupported("tool_choice", f"the decode node does not decode under a {kind!r} "
                                                               "constraint, which this tool_choice needs"))
    return tools


def wanted_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Top-n logprobs per token the client asked for (completions: logprobs=n; chat: logprobs + top_logprobs)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _engine_caps(state: RouterState) -> dict[str, Any] | None:
    """What the engine can honour: a node in rotation's capabilities, else the last ones any node reported, so that
    a request no node could decode is sent native as `unsupported:<param>` whether or not a node is up right now."""
    for node in [*state.pool.in_rotation(), *state.pool.nodes]:
        if node.capabilities is not None:
            return node.capabilities
    return None


async def _serve_low_latency(state: RouterState, request: Request, endpoint: Endpoint, req: CompletionRequest | ChatCompletionRequest,
                             body: dict[str, Any], route: Route, rid: str, t0: float, tl: Timeline) -> Response:
    caps = _engine_caps(state)
    if caps is None:
        raise _Fallback("no_node_in_rotation", RouterError(503, "no low-latency decode node is healthy", type="service_unavailable",
                                                           code="no_decode_node", headers={"retry-after": str(RETRY_AFTER_S)}))
    refusal = gate(req, caps.get("sampling") or {}, tool_parser=state.renderer.tools is not None)
    if refusal is not None:
        raise _Fallback(f"unsupported:{refusal.param}", unsupported(refusal.param, refusal.reason))
    tools = _tool_plan(state, req, body, caps)
    if tools is not None:
        await state.renderer.check_compiles(tools, rid)
    plan = await _plan(state, endpoint, req, int(caps.get("max_seq_len") or 0), rid, tools)
    if tools is not None and tools.choice == "none":
        tools = None  # rendered with the tools, answered as text: vLLM parses nothing under "none"
    tl.upto("admission")
    try:
        lease = await state.pool.acquire(state.config.queue_timeout_s)
    except LeaseTimeout as exc:
        tl.upto("queue_wait")
        raise _Fallback("busy", RouterError(429, f"{exc}; retry later", type="rate_limit_error", code="decode_pool_busy",
                                            headers={"retry-after": str(RETRY_AFTER_S)})) from None
    except NoNodeInRotation as exc:
        tl.upto("queue_wait")
        raise _Fallback("no_node_in_rotation", RouterError(503, str(exc), type="service_unavailable", code="no_decode_node",
                                                           headers={"retry-after": str(RETRY_AFTER_S)})) from None
    tl.upto("queue_wait", node=lease.node.name)
    state.metrics.lease_wait_seconds.observe(lease.waited_s)
    run = LowLatencyRun(state, plan, lease, rid, timeline=tl)
    run.user = req.user
    events = run.events()
    writer = ResponseWriter(endpoint, req.model or state.config.served_model_name)
    if plan.logprobs is not None:
        writer.logprobs = LogprobsRenderer(state.renderer.tokenizer, plan.logprobs)
    writer.tools = tools
    headers = {**_route_headers(route, rid), "x-tilepd-node": lease.node.name}
    try:
        first = await events.__anext__()  # prefill done: errors here still get a proper HTTP status
    except HandoffRefused as exc:  # before any byte went out: the native pool takes it, else the client gets the reason
        raise _Fallback("handoff_refused", exc) from None
    except (RouterError, PassThroughError) as exc:
        _count(state, route, exc.status, t0)
        _close_timeline(state, tl, route, exc.status)
        log.info("req=%s event=prefill_failed route=%s node=%s status=%d %s", rid, route.pool, lease.node.name, exc.status, tl.log_fields())
        exc.headers.update(headers)
        exc.headers["server-timing"] = tl.server_timing()
        raise
    state.metrics.ttft_seconds.observe(time.perf_counter() - t0)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # the headers go out now: they carry the phases up to the first token; the rest is in the log, metrics, traces
        headers["server-timing"] = tl.server_timing(partial=True)
        return EventStreamResponse(_sse(state, run, events, first, writer, include_usage, route, rid, t0), headers=headers)
    return await _collect_unless_disconnected(state, request, run, events, first, writer, route, rid, t0, headers)


async def _sse(state: RouterState, run: LowLatencyRun, events: AsyncIterator[TextDelta | Finished], first: TextDelta | Finished,
               writer: ResponseWriter, include_usage: bool, route: Route, rid: str, t0: float) -> AsyncIterator[bytes]:
    outcome = "disconnected"
    fin: Finished | None = None
    last_out: float | None = None  # when the last bytes went to the server (None: the client left before them)
    try:
        role = writer.role_chunk()
        if role is not None:
            yield role
        if writer.tools is not None:
            async for chunk in _tool_chunks(run, events, first, writer):
                if isinstance(chunk, Finished):
                    fin = chunk
                elif chunk:
                    yield chunk
        else:
            if isinstance(first, TextDelta) and (first.text or first.logprobs):
                yield writer.text_chunk(first.text, first.logprobs)
            async for ev in events:
                if isinstance(ev, TextDelta):
                    if ev.text or ev.logprobs:
                        yield writer.text_chunk(ev.text, ev.logprobs)
                else:
                    fin = ev
        assert fin is not None
        # the events after the last text go out in one write (EventStreamResponse ends the body with it)
        usage = writer.usage_chunk(fin.prompt_tokens, fin.completion_tokens) if include_usage else b""
        reason = writer.tools.stream_finish_reason(fin.finish_reason) if writer.tools is not None else fin.finish_reason
        last_out = time.perf_counter()
        yield writer.finish_chunk(reason, fin.stop_reason) + usage + DONE
        outcome = "ok"
    except (DecodeNodeError, RouterError) as exc:
        err = exc.to_router_error() if isinstance(exc, DecodeNodeError) else exc
        outcome = f"error:{err.code}"
        _note_decode_error(state, run, exc)
        last_out = time.perf_counter()
        yield error_chunk(err.body()) + DONE
    finally:
        run.settle_soon()
        _finish_log(state, route, rid, run, fin, 200, outcome, t0, t_end=last_out)


async def _tool_chunks(run: LowLatencyRun, events: AsyncIterator[TextDelta | Finished], first: TextDelta | Finished,
                       writer: ResponseWriter) -> AsyncIterator[bytes | Finished]:
    """Deltas through vLLM's tool parser (`parse_delta`), then the Finished event. Each delta is held until the next
    event, so the last one is parsed with finished=True, as vLLM parses the output that carries the finish reason."""
    tools = writer.tools
    held = first if isinstance(first, TextDelta) else None
    fin: Finished | None = first if isinstance(first, Finished) else None

    def chunk(ev: TextDelta, finished: bool) -> bytes:
        delta = tools.delta(ev.text, list(ev.tokens), run.plan.prompt_ids, finished)
        if delta is None and not ev.logprobs:
            return b""
        return writer.delta_chunk(delta or {}, ev.logprobs)

    async for ev in events:
        if isinstance(ev, Finished):
            fin = ev
            continue
        if held is not None:
            yield chunk(held, False)
        held = ev
    if held is not None:
        yield chunk(held, True)
    assert fin is not None
    yield fin


async def _collect_unless_disconnected(state: RouterState, request: Request, run: LowLatencyRun,
                                       events: AsyncIterator[TextDelta | Finished], first: TextDelta | Finished,
                                       writer: ResponseWriter, route: Route, rid: str, t0: float, headers: dict[str, str]) -> Response:
    records: list = []
    token_ids: list[int] = []  # for vLLM's tool parser

    async def collect() -> tuple[str, Finished]:
        parts = [first.text] if isinstance(first, TextDelta) else []
        if isinstance(first, TextDelta):
            records.extend(first.logprobs)
            token_ids.extend(first.tokens)
        fin: Finished | None = None
        async for ev in events:
            if isinstance(ev, TextDelta):
                parts.append(ev.text)
                records.extend(ev.logprobs)
                token_ids.extend(ev.tokens)
            else:
                fin = ev
        assert fin is not None
        return "".join(parts), fin

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            run.settle_soon()
    if not work.done() or work.cancelled():
        _finish_log(state, route, rid, run, None, 499, "disconnected", t0)
        return Response(status_code=499)
    try:
        text, fin = work.result()
    except (DecodeNodeError, RouterError) as exc:
        err = exc.to_router_error() if isinstance(exc, DecodeNodeError) else exc
        _note_decode_error(state, run, exc)
        _finish_log(state, route, rid, run, None, err.status, f"error:{err.code}", t0)
        return JSONResponse(err.body(), status_code=err.status, headers={**headers, **err.headers,
                                                                          "server-timing": run.timeline.server_timing()})
    _finish_log(state, route, rid, run, fin, 200, "ok", t0)
    headers = {**headers, "server-timing": run.timeline.server_timing()}
    message, reason = None, fin.finish_reason
    if writer.tools is not None:  # content and tool_calls as vLLM's tool parser reads the text
        message, reason = writer.tools.message(text, token_ids, run.plan.prompt_ids, fin.finish_reason)
    body = writer.full(text, reason, fin.stop_reason, fin.prompt_tokens, fin.completion_tokens, records, message)
    return JSONResponse(body, headers=headers)


def _note_decode_error(state: RouterState, run: LowLatencyRun, exc: Exception) -> None:
    if isinstance(exc, DecodeNodeError):
        state.metrics.decode_errors.labels(exc.node, exc.code).inc()
        log.warning("req=%s event=decode_error node=%s status=%d code=%s message=%s", run.request_id, exc.node, exc.status,
                    exc.code, exc.message)


def _finish_log(state: RouterState, route: Route, rid: str, run: LowLatencyRun, fin: Finished | None, status: int,
                outcome: str, t0: float, t_end: float | None = None) -> None:
    _count(state, route, status, t0)
    if fin is not None:
        state.metrics.completion_tokens.inc(fin.completion_tokens)
    tl = run.timeline
    tl.attrs["outcome"] = outcome
    _close_timeline(state, tl, route, status, t_end)
    log.info("req=%s event=done route=%s reason=%s node=%s status=%d outcome=%s prompt_tokens=%d completion_tokens=%s finish=%s "
             "ms=%.1f prefill_ms=%s failovers=%d user=%s transfers=%s %s", rid, route.pool, route.reason, run.lease.node.name, status,
             outcome, run.prompt_tokens, fin.completion_tokens if fin else "-", fin.finish_reason if fin else "-", tl.total_ms,
             f"{fin.timings['prefill_ms']:.1f}" if fin and "prefill_ms" in fin.timings else "-", run.failovers, run.user or "-",
             ",".join(run.transfers) or "-", _why(run) + tl.log_fields())


def _why(run: LowLatencyRun) -> str:
    """`retries=<node>:<cause>;...` when nodes failed the request (the timeline's failed_attempt phases say how long)."""
    causes = [f"{s.attrs.get('node', '?')}:{s.attrs.get('cause', '?')}" for s in run.timeline.spans if s.name == "failed_attempt"]
    return f"retries={';'.join(causes)} " if causes else ""


async def _serve_native(state: RouterState, endpoint: Endpoint, body: dict[str, Any], route: Route, rid: str, t0: float,
                        tl: Timeline) -> Response:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if not tl.spans:
        tl.upto("admission")
    chosen = route.reason in ("header", "model", "default")  # routed native on purpose; any other reason is a fallback
    if not chosen:
        tl.attrs["fallback"] = route.reason

    def done(status: int, outcome: str, t_end: float | None = None) -> None:  # after the last byte (streams: when the relay ends)
        _count(state, route, status, t0)
        _close_timeline(state, tl, route, status, t_end)
        log.info("req=%s event=done route=native reason=%s status=%d outcome=%s ms=%.1f runbook=%s %s%s", rid, route.reason, status,
                 outcome, tl.total_ms, "-" if chosen else "RB-native-fallback", f"fallback={route.reason} " if not chosen else "",
                 tl.log_fields())

    try:
        resp = await serve_native(state, path, body, rid, _route_headers(route, rid), timeline=tl, on_done=done)
    except (RouterError, PassThroughError) as exc:
        _count(state, route, exc.status, t0)
        _close_timeline(state, tl, route, exc.status)
        detail = exc.message if isinstance(exc, RouterError) else exc.body[:300].decode("utf-8", "replace")
        log.info("req=%s event=native_failed route=native reason=%s status=%d error=%r %s", rid, route.reason, exc.status, detail,
                 tl.log_fields())
        exc.headers.update(_route_headers(route, rid))
        exc.headers["server-timing"] = tl.server_timing()
        raise
    return resp


async def _shutdown(state: RouterState) -> None:
    """Cancel decodes still running on leased nodes, then close the upstream client."""
    leased = [n for n in state.pool.nodes if n.leased and n.transfer_id]
    await asyncio.gather(*(cancel_decode(state.client, n.base_url, n.transfer_id or "", headers=state.node_headers) for n in leased), return_exceptions=True)
    pending = list(state.background)
    if pending:
        await asyncio.wait(pending, timeout=5.0)
    await state.client.aclose()
    await asyncio.to_thread(state.renderer.close)
    if state.tracing is not None:
        await asyncio.get_running_loop().run_in_executor(None, state.tracing.shutdown)
    log.info("event=stopped cancelled_decodes=%d", len(leased))
