"""HTTP API of the decode node (INTERFACES §4), on FastAPI.

Errors before the first token are HTTP statuses with `{"error": {code, message, param?}}`:
429 busy, 504 KV never arrived (slot freed), 400 bad/unknown parameter, 501 a
parameter this engine cannot honour, 499 cancelled, 409 token mismatch or a second
request for the same transfer, 502 the transfer failed (sender gone or reported an error),
503 `draining` (the router goes to another node). Once tokens flow, a cancel ends the stream
with finish_reason "cancelled".

Drain (`POST /admin/drain`, `/admin/undrain`; `tilepd drain`): the transfer that holds the
slot finishes, no new one may take it (decode requests 503 `draining`, control admits a
`busy` reject), and `/health` answers 503 `{"status": "draining", "idle": ...}` so health
pollers (the router's, `proc wait`) stop sending work while `/status` still shows the node
alive. A restarted node starts undrained.

With a deployment secret (tilepd.auth), the mutating calls (/v1/decode, /v1/cancel, /admin/*)
need the router's bearer key and /v1/decode a transfer token derived from the secret; anything
else is 401 before the slot is touched. Read-only endpoints stay open: they carry no secret.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from starlette.concurrency import run_in_threadpool

from tilepd.auth import bearer_ok, transfer_token_ok
from tilepd.contracts.decode_http import CancelBody, DecodeBody
from tilepd.runtime.service import DecodeJob, DecodeService
from tilepd.runtime.slot import SlotError
from tilepd.runtime.token_stream import TokenStream

log = logging.getLogger("tilepd.runtime.http")

# Parameters a client may send that some engines cannot honour: (field, value that means "off").
OPTIONAL_FEATURES: dict[str, Any] = {
    "logprobs": None, "top_logprobs": None, "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "min_p": 0.0,
}
# Sampling parameters the engine must declare (capabilities) when set to a non-default value.
SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop_token_ids": [], "ignore_eos": False}

ADMIN_PATHS = frozenset({"/admin/drain", "/admin/undrain"})
MUTATING_PATHS = frozenset({"/v1/decode", "/v1/cancel"}) | ADMIN_PATHS

SLOT_STATUS = {"busy": 429, "bad_token": 409, "duplicate": 409, "kv_timeout": 504, "cancelled": 499, "transfer_failed": 502,
               "kv_checksum_mismatch": 502,  # the KV that landed is not what the prefill staged: never decoded
               "draining": 503}  # retryable: the router goes to another node


def _error(status: int, code: str, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    err: dict[str, Any] = {"code": code, "message": message}
    if param:
        err["param"] = param
    return JSONResponse({"error": err}, status_code=status, headers=headers)


def _unhonoured(body: DecodeBody, caps: dict[str, Any]) -> str | None:
    for name, off in OPTIONAL_FEATURES.items():
        if getattr(body, name) not in (off, False) and not caps.get(name, False):
            return name
    for name, default in SAMPLING_DEFAULTS.items():
        if getattr(body, name) != default and not caps.get(name, False):
            return name
    return None


def _logprobs_wanted(body: DecodeBody) -> int | None:
    """How many top logprobs per token the request wants (0: only the sampled token's), or None for none."""
    if body.top_logprobs is not None:
        return body.top_logprobs
    if body.logprobs is None or body.logprobs is False:
        return None
    return 0 if body.logprobs is True else int(body.logprobs)


def _unauthorized(message: str, code: str = "unauthorized") -> JSONResponse:
    return _error(401, code, message, headers={"www-authenticate": "Bearer"})


def drain_state(svc: DecodeService) -> dict[str, Any]:
    """What `tilepd drain` waits on: draining, and idle once the slot is free (final while draining)."""
    snap = svc.slot.snapshot()
    return {"draining": svc.slot.draining, "idle": not snap["busy"], "state": snap["state"], "transfer_id": snap["transfer_id"]}


def _register_drain_gauge(svc: DecodeService) -> None:
    gauge = Gauge("tilepd_decode_draining", "1 while the node is draining (takes no new request)", registry=None)
    gauge.set_function(lambda: 1.0 if svc.slot.draining else 0.0)
    try:
        svc.metrics.registry.register(gauge)
    except ValueError:  # a second app over the same service: the gauge is there already
        pass


def build_app(svc: DecodeService, secret: bytes | None = None) -> FastAPI:
    """The node's app; with `secret`, only a caller holding the deployment secret may change its state."""
    app = FastAPI(title="tilepd decode node", docs_url=None, redoc_url=None)
    _register_drain_gauge(svc)

    if secret is not None:
        def _authenticate(inner: Any) -> Any:
            # a plain ASGI wrapper, not @app.middleware("http"): that one relays every chunk of a streamed response
            # through a memory stream, which cost as much event-loop CPU per token as the rest of the stream
            # (bench/served_decode.py --device cpu --tiny, with and without --no-secret)
            async def asgi(scope: dict, receive: Any, send: Any) -> None:
                # before the body is parsed: a stranger learns nothing about the parameters either
                if scope["type"] == "http":
                    request = Request(scope)
                    if request.url.path in MUTATING_PATHS and not bearer_ok(secret, request.headers.get("authorization")):
                        svc.metrics.requests.labels("unauthorized").inc()
                        log.warning("event=unauthorized path=%s peer=%s", request.url.path, request.client.host if request.client else "?")
                        await _unauthorized("missing or invalid node API key (only the router may call this endpoint)")(scope, receive, send)
                        return
                await inner(scope, receive, send)

            return asgi

        app.add_middleware(_authenticate)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_req: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = f"unknown parameter {param!r}" if first.get("type") == "extra_forbidden" else f"{param or 'body'}: {first['msg']}"
        return _error(400, "bad_parameter", msg, param)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not svc.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        problem = svc.health_problem()
        if problem:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        listeners = svc.listener_problems()
        down = [p for p in listeners.values() if p]
        if down:  # a port that takes no connection: every request leased here would wait for nothing
            return JSONResponse({"status": "unhealthy", "reason": "; ".join(down),
                                 "listeners": {k: v or "ok" for k, v in listeners.items()}}, status_code=503)
        if svc.slot.draining:  # 503: pollers take it out of rotation; the body says it is alive
            return JSONResponse({"status": "draining", "idle": not svc.slot.busy}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/capabilities")
    async def capabilities() -> dict:
        return svc.capabilities()

    @app.get("/status")
    async def status() -> dict:
        return {**svc.status(), "draining": svc.slot.draining}

    @app.post("/admin/drain")
    async def drain() -> dict:
        svc.set_draining(True)
        state = drain_state(svc)
        log.warning("event=drain idle=%s state=%s transfer_id=%s", state["idle"], state["state"], state["transfer_id"])
        return state

    @app.post("/admin/undrain")
    async def undrain() -> dict:
        svc.set_draining(False)
        log.warning("event=undrain")
        return drain_state(svc)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(svc.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/cancel")
    async def cancel(body: CancelBody) -> dict:
        found = svc.slot.cancel(body.transfer_id)
        log.info("event=cancel transfer_id=%s found=%s", body.transfer_id, found)
        return {"transfer_id": body.transfer_id, "cancelled": found}

    @app.post("/v1/decode")
    async def decode(body: DecodeBody, request: Request):  # noqa: ANN202 - JSON or a stream
        tid = body.transfer_id
        if secret is not None and not transfer_token_ok(secret, tid, body.token):
            svc.metrics.requests.labels("unauthorized").inc()
            log.warning("event=decode_refused transfer_id=%s code=invalid_transfer_token", tid)
            return _unauthorized(f"token of transfer {tid} was not minted with this deployment's secret", "invalid_transfer_token")
        if not svc.ready:
            return _error(503, "not_ready", "decode node is starting")
        caps = svc.capabilities()["sampling"]
        bad = _unhonoured(body, caps)
        if bad is not None:
            svc.metrics.requests.labels("unsupported").inc()
            return _error(501, "unsupported_parameter", f"this decode engine cannot honour {bad!r}", bad)
        want_logprobs = _logprobs_wanted(body)
        if want_logprobs is not None and want_logprobs > int(caps.get("top_logprobs_max", 0)):
            field = "top_logprobs" if body.top_logprobs is not None else "logprobs"
            return _error(400, "bad_parameter", f"{field} {want_logprobs} exceeds this engine's top_logprobs_max "
                          f"{caps.get('top_logprobs_max', 0)}", field)
        if body.prompt_tokens + body.max_tokens > svc.config.max_seq_len:
            return _error(400, "too_long", f"prompt_tokens {body.prompt_tokens} + max_tokens {body.max_tokens} exceeds "
                          f"max_seq_len {svc.config.max_seq_len}", "max_tokens")
        vocab = svc.engine.config.vocab_size
        if body.first_token >= int(vocab):
            return _error(400, "bad_parameter", f"first_token {body.first_token} outside the vocabulary ({vocab})", "first_token")
        grammar = None
        if body.structured_output is not None:
            so = body.structured_output
            if so.type not in (caps.get("structured_output") or ()):
                svc.metrics.requests.labels("unsupported").inc()
                return _error(501, "unsupported_parameter", f"this decode engine cannot honour structured_output {so.type!r}",
                              "structured_output.type")
            try:
                grammar = await run_in_threadpool(svc.grammar_for, so.type, so.spec, body.stop_token_ids)
            except ValueError as exc:  # grammar.GrammarError: names the field
                return _error(400, "bad_parameter", str(exc), getattr(exc, "field", "structured_output"))
            if not grammar.accept(body.first_token):
                return _error(400, "bad_parameter", f"first_token {body.first_token} is not allowed by the structured_output "
                              "constraint (the prefill must sample it under the same constraint)", "first_token")
        t_arrive = time.perf_counter()
        arrived_ns = time.time_ns()
        try:
            transfer = svc.slot.reserve_for_decode(tid, body.token)
        except SlotError as exc:
            svc.metrics.requests.labels(exc.code).inc()
            log.info("event=decode_refused transfer_id=%s code=%s", tid, exc.code)
            return _error(SLOT_STATUS.get(exc.code, 409), exc.code, exc.message,
                          headers={"Retry-After": "1"} if exc.code == "busy" else None)
        timeout = body.kv_timeout_s or svc.config.kv_timeout_s
        try:
            await run_in_threadpool(svc.slot.wait_complete, transfer, timeout)
            if transfer.seq_len != body.prompt_tokens:
                svc.slot.release(transfer, "prompt_tokens mismatch")
                return _error(400, "bad_parameter", f"prompt_tokens {body.prompt_tokens} but the KV received covers "
                              f"{transfer.seq_len} tokens", "prompt_tokens")
            svc.slot.start_decoding(transfer)
        except SlotError as exc:
            svc.metrics.requests.labels(exc.code).inc()
            log.warning("event=decode_failed transfer_id=%s code=%s message=%s", tid, exc.code, exc.message)
            return _error(SLOT_STATUS.get(exc.code, 500), exc.code, exc.message)
        wait_s = time.perf_counter() - t_arrive
        svc.metrics.wait.observe(wait_s)
        # the wire time as this node saw it (admit -> every rank done); it overlaps the router's prefill call
        transfer_ms = ((transfer.completed_at - transfer.admitted_at) * 1e3
                       if transfer.completed_at is not None and transfer.admitted_at is not None else None)
        rid = request.headers.get("x-request-id", "-")

        loop = asyncio.get_running_loop()
        queue = TokenStream(loop)  # engine thread -> NDJSON chunks (token_stream.py: one wake-up per read, not per token)
        sampling = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "seed", "ignore_eos")}
        sampling["stop_token_ids"] = tuple(body.stop_token_ids)
        token_logprobs: list[dict[str, Any]] = []  # non-streamed: every token's, in order
        if want_logprobs is None:
            job = DecodeJob(body.first_token, body.max_tokens, sampling, queue.push, grammar=grammar)
        else:
            def on_logprobs(lp: Any) -> None:  # called right before on_token, with the same token
                entry = {"token": lp.token, **lp.to_json()}
                token_logprobs.append(entry)
                queue.push(entry)

            job = DecodeJob(body.first_token, body.max_tokens, sampling, lambda t: None, logprobs=want_logprobs,
                            on_logprobs=on_logprobs, grammar=grammar)

        t_submit = time.perf_counter()
        started: list[float] = []

        def work() -> Any:
            started.append(time.perf_counter())
            try:
                return svc.run_decode(transfer, job)
            finally:
                svc.slot.release(transfer, "cancelled" if transfer.cancel.is_set() else "finished")

        future = asyncio.wrap_future(svc.worker.submit(work))
        future.add_done_callback(lambda f: queue.close())
        log.info("event=decode_start transfer_id=%s req=%s seq_len=%d max_tokens=%d wait_ms=%.2f", tid, rid, transfer.seq_len,
                 body.max_tokens, wait_s * 1e3)

        def final(outcome: Any) -> dict[str, Any]:
            # the node's phases, in order (the router's timeline places them in its decode stretch; INTERFACES §4)
            timings = {"wait_ms": wait_s * 1e3, "queue_ms": ((started[0] if started else t_submit) - t_submit) * 1e3, **outcome.timings}
            if transfer_ms is not None:
                timings["transfer_ms"] = transfer_ms
            timings["node_ms"] = (time.perf_counter() - t_arrive) * 1e3
            traceparent = request.headers.get("traceparent")
            if svc.tracing is not None and traceparent:
                try:
                    if svc.tracing.export(traceparent, arrived_ns, timings, tid, outcome.finish_reason):
                        timings["traced"] = 1  # the router then leaves these phases out of its own export
                except Exception as exc:  # noqa: BLE001 - tracing never fails a decode
                    log.warning("event=tracing_error transfer_id=%s error=%r", tid, exc)
            svc.last = timings
            svc.metrics.requests.labels(outcome.finish_reason).inc()
            log.info("event=decode_done transfer_id=%s req=%s finish=%s %s", tid, rid, outcome.finish_reason, " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in timings.items()))
            return timings

        if not body.stream:
            try:
                outcome = await future
            except Exception as exc:  # noqa: BLE001 - engine failure becomes a typed 500
                log.exception("event=decode_error transfer_id=%s", tid)
                return _error(500, "engine_error", f"{type(exc).__name__}: {exc}")
            timings = final(outcome)
            if outcome.finish_reason == "cancelled" and not outcome.tokens:
                return _error(499, "cancelled", f"transfer {tid} was cancelled")
            out = {"tokens": outcome.tokens, "finish_reason": outcome.finish_reason,
                   "completion_tokens": len(outcome.tokens), "timings": timings}
            if want_logprobs is not None:
                out["logprobs"] = [{k: v for k, v in e.items() if k != "token"} for e in token_logprobs]
            return out

        async def stream() -> AsyncIterator[bytes]:
            finished = False
            try:
                while True:
                    kind, val = await queue.get()
                    if kind == "token":  # val: NDJSON lines, {"token"} or {"token", "logprob", "top_logprobs"} each
                        yield val
                        continue
                    try:
                        outcome = future.result()
                    except Exception as exc:  # noqa: BLE001
                        log.exception("event=decode_error transfer_id=%s", tid)
                        yield (json.dumps({"done": True, "finish_reason": "error", "error": {"code": "engine_error", "message": str(exc)}}) + "\n").encode()
                        finished = True
                        return
                    timings = final(outcome)
                    yield (json.dumps({"done": True, "finish_reason": outcome.finish_reason,
                                       "completion_tokens": len(outcome.tokens), "timings": timings}) + "\n").encode()
                    finished = True
                    return
            finally:
                if not finished:  # the client went away: stop the engine at its next step
                    log.info("event=client_gone transfer_id=%s", tid)
                    transfer.cancel.set()

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    return app
