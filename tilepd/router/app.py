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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from tilepd.auth import bearer_ok, load_secret, vllm_auth_header
from tilepd.contracts.fingerprint import Fingerprint
from tilepd.contracts.marker import FINGERPRINT_REFUSAL
from tilepd.contracts.service_configs import RouterConfig
from tilepd.router.auth import ApiKeys
from tilepd.router.backends import DecodeNodeError, cancel_decode
from tilepd.router.call import Call
from tilepd.router.errors import PassThroughError, RouterError, invalid, unsupported
from tilepd.router.gate import gate
from tilepd.router.health import probe_all, probe_forever
from tilepd.router.divergence_watch import DivergenceWatch
from tilepd.router.drain import InFlight
from tilepd.router.leases import LeaseTimeout, NodePool, NodeState, NoNodeInRotation
from tilepd.router.limits import BodySizeLimit
from tilepd.router.logprobs import LogprobsRenderer
from tilepd.router.structured import structured_plan
from tilepd.router.tools import ToolCalling, ToolPlan, Unsupported
from tilepd.router.lowlatency import EnginePlan, Finished, HandoffRefused, LowLatencyRun, TextDelta
from tilepd.router.metrics import RouterMetrics
from tilepd.router.native import serve_native
from tilepd.router.prompts import PromptRenderer, refuse_client_template
from tilepd.router.reasons import bounded_reason
from tilepd.router.reservations import lease_node, router_identity
from tilepd.router.protocol import ChatCompletionRequest, CompletionRequest, Endpoint
from tilepd.router.responses import DONE, EventStreamResponse, ResponseWriter, error_chunk
from tilepd.router.routing import Route, choose_route, served_models
from tilepd.router.state import RouterState
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
                       tracing=make_tracing(config.otlp_endpoint), identity=router_identity(config))


def create_app(config: RouterConfig, keys: ApiKeys) -> FastAPI:
    """The ASGI app; tokenizer loading happens here so a bad tokenizer_dir fails at startup."""
    state = build_state(config, keys)
    state.watch = DivergenceWatch(state, config.divergence_watch)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        lag_watch = asyncio.get_running_loop().create_task(state.loop_lag.run())
        await probe_all(state)
        log.info("event=started nodes_in_rotation=%d/%d native_pool=%s auth=%s", len(state.pool.in_rotation()),
                 len(state.pool.nodes), config.native_pool is not None, "open" if keys.open else "bearer")
        prober = asyncio.get_running_loop().create_task(probe_forever(state, config.health_interval_s))
        watcher = asyncio.get_running_loop().create_task(state.watch.run()) if config.divergence_watch.enabled else None
        try:
            yield
        finally:
            prober.cancel()
            lag_watch.cancel()
            if watcher is not None:
                watcher.cancel()
            await _shutdown(state)

    app = FastAPI(title="tilepd router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = state
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(InFlight, counter=state.drain)  # outermost: a request counts from its first byte to its last

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(PassThroughError)
    async def _pass_through(_: Request, exc: PassThroughError) -> Response:
        return Response(exc.body, status_code=exc.status, media_type=exc.content_type, headers=exc.headers)

    @app.get("/health")
    async def health() -> Any:
        body = {"status": "draining" if state.drain.draining else "ok", "nodes_in_rotation": len(state.pool.in_rotation()),
                "nodes": len(state.pool.nodes), "native_pool": config.native_pool is not None, "in_flight": state.drain.in_flight}
        # 503 while draining: the balancer's checks take this router out (drain.py)
        return JSONResponse(body, status_code=503) if state.drain.draining else body

    @app.post("/admin/drain")
    async def drain(request: Request) -> dict[str, Any]:
        _admin(state, request)
        return state.drain.set(True)

    @app.post("/admin/undrain")
    async def undrain(request: Request) -> dict[str, Any]:
        _admin(state, request)
        return state.drain.set(False)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        keys.check(request.headers.get("authorization"))
        return {"router": state.identity, "queue_depth": state.pool.queue_depth, "nodes": [
            {"name": n.name, "url": n.base_url, "in_rotation": n.in_rotation, "leased": n.leased, "transfer_id": n.transfer_id,
             "held_by": n.held_by, "consecutive_failures": n.consecutive_failures, "last_error": n.last_error,
             "leases_total": n.leases_total, "draining": n.draining, "fingerprint": _fingerprint_id(n)}
            for n in state.pool.nodes], "divergence": state.watch.status()}

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


def _admin(state: RouterState, request: Request) -> None:
    """Only a holder of the deployment secret drains a router (the key of a decode node's admin calls; open in a dev
    run without a secret)."""
    if state.node_secret is not None and not bearer_ok(state.node_secret, request.headers.get("authorization")):
        raise RouterError(401, "missing or invalid deployment key (the router's admin calls take the decode nodes' key)",
                          type="authentication_error", code="unauthorized")


async def _handle(state: RouterState, request: Request, endpoint: Endpoint) -> Response:
    call = Call(state, request, endpoint)
    try:
        await _admit(call)
    except RouterError as exc:
        call.refused_at_admission(exc)
        raise
    if call.route.pool == "low_latency":
        try:
            return await _serve_low_latency(call)
        except _Fallback as fb:
            _fall_back(call, fb)
    return await _serve_native(call)


async def _admit(call: Call) -> None:
    """Authenticate, parse, validate and route the request (any RouterError: refused before any pool)."""
    state, request = call.state, call.request
    state.keys.check(request.headers.get("authorization"))
    call.body = await _read_json(request)
    call.req = _validate(call.endpoint, call.body)
    if call.endpoint == "chat":  # before any pool: the native vLLM would render a client's template too
        refuse_client_template(call.body, state.config.prompt_render.allowed_template_kwargs)
    call.route = choose_route(state.config, call.req.model, request.headers)


def _fingerprint_id(node: NodeState) -> str | None:
    """The short id of the fingerprint a node last reported (its /capabilities), None before it did."""
    raw = (node.capabilities or {}).get("fingerprint")
    try:
        return Fingerprint.model_validate(raw).id if raw else None
    except ValueError:
        return None


def _fall_back(call: Call, fb: _Fallback) -> None:
    """The low-latency pool cannot take the request: route it native, or raise what the client gets without a native pool."""
    tl = call.timeline
    if not tl.spans:
        tl.upto("admission")
    tl.attrs["fallback"] = fb.reason
    cfg = call.state.config
    if cfg.native_pool is None or not cfg.routing.fallback_to_native:
        call.route = Route("low_latency", fb.reason)
        call.refused(fb.error, "refused", f"route=low_latency reason={fb.reason} status={fb.error.status} "
                     f"runbook={fb.error.runbook or '-'}")
        raise fb.error from None
    call.route = Route("native", fb.reason)


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


async def _plan(call: Call, max_seq_len: int, tools: ToolPlan | None = None) -> EnginePlan:
    renderer, req = call.state.renderer, call.req
    if isinstance(req, ChatCompletionRequest):
        prompt_ids = await renderer.chat_ids(req, call.rid, tools.tool_dicts if tools is not None else None)
        limit, limit_name = req.token_limit(), ("max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    else:
        prompt_ids = await renderer.completion_ids(req, call.rid)
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


async def _serve_low_latency(call: Call) -> Response:
    state, req, tl = call.state, call.req, call.timeline
    caps = _engine_caps(state)
    if caps is None:
        raise _Fallback("no_node_in_rotation", RouterError(503, "no low-latency decode node is healthy", type="service_unavailable",
                                                           code="no_decode_node", headers={"retry-after": str(RETRY_AFTER_S)}))
    refusal = gate(req, caps.get("sampling") or {}, tool_parser=state.renderer.tools is not None)
    if refusal is not None:
        raise _Fallback(f"unsupported:{refusal.param}", unsupported(refusal.param, refusal.reason))
    tools = _tool_plan(state, req, call.body, caps)
    if tools is not None:
        await state.renderer.check_compiles(tools, call.rid)
    plan = await _plan(call, int(caps.get("max_seq_len") or 0), tools)
    if tools is not None and tools.choice == "none":
        tools = None  # rendered with the tools, answered as text: vLLM parses nothing under "none"
    tl.upto("admission")
    try:
        lease = await lease_node(state, state.config.queue_timeout_s)
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
    run = LowLatencyRun(state, plan, lease, call.rid, timeline=tl)
    run.user = req.user
    events = run.events()
    writer = ResponseWriter(call.endpoint, req.model or state.config.served_model_name)
    if plan.logprobs is not None:
        writer.logprobs = LogprobsRenderer(state.renderer.tokenizer, plan.logprobs)
    writer.tools = tools
    headers = {**call.route_headers(), "x-tilepd-node": lease.node.name}
    try:
        first = await events.__anext__()  # prefill done: errors here still get a proper HTTP status
    except HandoffRefused as exc:  # before any byte went out: the native pool takes it, else the client gets the reason
        raise _Fallback("fingerprint_mismatch" if exc.reason.startswith(FINGERPRINT_REFUSAL) else "handoff_refused", exc) from None
    except (RouterError, PassThroughError) as exc:
        call.refused(exc, "prefill_failed", f"route={call.route.pool} node={lease.node.name} status={exc.status}", headers)
        raise
    state.metrics.ttft_seconds.observe(time.perf_counter() - call.t0)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # the headers go out now: they carry the phases up to the first token; the rest is in the log, metrics, traces
        headers["server-timing"] = tl.server_timing(partial=True)
        return EventStreamResponse(_sse(call, run, events, first, writer, include_usage), headers=headers)
    return await _collect_unless_disconnected(call, run, events, first, writer, headers)


async def _sse(call: Call, run: LowLatencyRun, events: AsyncIterator[TextDelta | Finished], first: TextDelta | Finished,
               writer: ResponseWriter, include_usage: bool) -> AsyncIterator[bytes]:
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
        _note_decode_error(call.state, run, exc)
        last_out = time.perf_counter()
        yield error_chunk(err.body()) + DONE
    finally:
        run.settle_soon()
        call.finished(run, fin, 200, outcome, t_end=last_out)


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


async def _collect_unless_disconnected(call: Call, run: LowLatencyRun, events: AsyncIterator[TextDelta | Finished],
                                       first: TextDelta | Finished, writer: ResponseWriter, headers: dict[str, str]) -> Response:
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
        while (await call.request.receive())["type"] != "http.disconnect":
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
        call.finished(run, None, 499, "disconnected")
        return Response(status_code=499)
    try:
        text, fin = work.result()
    except (DecodeNodeError, RouterError) as exc:
        err = exc.to_router_error() if isinstance(exc, DecodeNodeError) else exc
        _note_decode_error(call.state, run, exc)
        call.finished(run, None, err.status, f"error:{err.code}")
        return JSONResponse(err.body(), status_code=err.status, headers={**headers, **err.headers,
                                                                          "server-timing": run.timeline.server_timing()})
    call.finished(run, fin, 200, "ok")
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


async def _serve_native(call: Call) -> Response:
    path = "/v1/chat/completions" if call.endpoint == "chat" else "/v1/completions"
    tl = call.timeline
    if not tl.spans:
        tl.upto("admission")
    if not call.native_by_choice:
        tl.attrs["fallback"] = call.route.reason
    try:
        resp = await serve_native(call.state, path, call.body, call.rid, call.route_headers(), timeline=tl, on_done=call.finished_native)
    except (RouterError, PassThroughError) as exc:
        detail = exc.message if isinstance(exc, RouterError) else exc.body[:300].decode("utf-8", "replace")
        call.refused(exc, "native_failed", f"route=native reason={call.route.reason} status={exc.status} error={detail!r}")
        raise
    return resp


async def _shutdown(state: RouterState) -> None:
    """Cancel decodes still running on leased nodes (their reservations end with them), then close the upstream client."""
    for watch in state.slot_watches.values():
        watch.cancel()
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
