"""HTTP API of the decode node (INTERFACES §4), on FastAPI: the routes; `/v1/decode` runs as the steps of decode_call.py.

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

Reservations (node API 2, reservations.py): a router reserves the slot before the prefill (`POST /v1/reserve`),
renews it (`POST /v1/renew`) while its request lives, and waits for a busy slot on `GET /v1/slot?wait_s=`; the lease
clock runs on this app's event loop.

With a deployment secret (tilepd.auth), the mutating calls (/v1/reserve, /v1/renew, /v1/decode, /v1/cancel, /admin/*)
need the router's bearer key and /v1/reserve and /v1/decode a transfer token derived from the secret; anything
else is 401 before the slot is touched. Read-only endpoints stay open: they carry no secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest

from tilepd.auth import bearer_ok
from tilepd.contracts.decode_http import CancelBody, DecodeBody, DrainBody, RenewBody, ReserveBody
from tilepd.runtime import reservations
from tilepd.runtime.decode_call import serve_decode
from tilepd.runtime.http_errors import error_response, unauthorized
from tilepd.runtime.service import DecodeService

log = logging.getLogger("tilepd.runtime.http")

ADMIN_PATHS = frozenset({"/admin/drain", "/admin/undrain"})
MUTATING_PATHS = frozenset({"/v1/reserve", "/v1/renew", "/v1/decode", "/v1/cancel"}) | ADMIN_PATHS


def drain_state(svc: DecodeService) -> dict[str, Any]:
    """What `tilepd drain` waits on: draining, and idle once the slot is free (final while draining)."""
    snap = svc.slot.snapshot()
    return {"draining": svc.slot.draining, "idle": not snap["busy"], "state": snap["state"], "transfer_id": snap["transfer_id"],
            "reason": svc.drain_reason}


def _register_drain_gauge(svc: DecodeService) -> None:
    gauge = Gauge("tilepd_decode_draining", "1 while the node is draining (takes no new request)", registry=None)
    gauge.set_function(lambda: 1.0 if svc.slot.draining else 0.0)
    try:
        svc.metrics.registry.register(gauge)
    except ValueError:  # a second app over the same service: the gauge is there already
        pass


def _authenticate(inner: Any, svc: DecodeService, secret: bytes) -> Any:
    """Only the router may call a mutating endpoint: its bearer key, checked before the body is parsed (a stranger
    learns nothing about the parameters either)."""
    # a plain ASGI wrapper, not @app.middleware("http"): that one relays every chunk of a streamed response
    # through a memory stream, which cost as much event-loop CPU per token as the rest of the stream
    # (bench/served_decode.py --device cpu --tiny, with and without --no-secret)
    async def asgi(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            if request.url.path in MUTATING_PATHS and not bearer_ok(secret, request.headers.get("authorization")):
                svc.metrics.requests.labels("unauthorized").inc()
                log.warning("event=unauthorized path=%s peer=%s", request.url.path, request.client.host if request.client else "?")
                await unauthorized("missing or invalid node API key (only the router may call this endpoint)")(scope, receive, send)
                return
        await inner(scope, receive, send)

    return asgi


async def _bad_request(_req: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = f"unknown parameter {param!r}" if first.get("type") == "extra_forbidden" else f"{param or 'body'}: {first['msg']}"
    return error_response(400, "bad_parameter", msg, param)


def _health(svc: DecodeService) -> JSONResponse:
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
        return JSONResponse({"status": "draining", "idle": not svc.slot.busy, "reason": svc.drain_reason}, status_code=503)
    # the fingerprint's id: a poller sees a restart onto other weights at its next check (the router re-reads /capabilities)
    return JSONResponse({"status": "ok", "fingerprint": svc.fingerprint.id if svc.fingerprint is not None else None})


def build_app(svc: DecodeService, secret: bytes | None = None) -> FastAPI:
    """The node's app; with `secret`, only a caller holding the deployment secret may change its state."""
    slot_free = reservations.SlotFreeSignal()
    svc.slot.on_free = slot_free.fire

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        slot_free.bind(asyncio.get_running_loop())
        clock = asyncio.get_running_loop().create_task(reservations.run_lease_clock(svc))
        try:
            yield
        finally:
            clock.cancel()

    app = FastAPI(title="tilepd decode node", docs_url=None, redoc_url=None, lifespan=lifespan)
    _register_drain_gauge(svc)
    if secret is not None:
        app.add_middleware(_authenticate, svc=svc, secret=secret)
    app.add_exception_handler(RequestValidationError, _bad_request)

    @app.get("/health")
    async def health() -> JSONResponse:
        return _health(svc)

    @app.get("/capabilities")
    async def capabilities() -> dict:
        return svc.capabilities()

    @app.get("/status")
    async def status() -> dict:
        return {**svc.status(), "draining": svc.slot.draining, "drain_reason": svc.drain_reason}

    @app.post("/admin/drain")
    async def drain(body: DrainBody | None = None) -> dict:
        svc.set_draining(True, body.reason if body is not None else None)
        state = drain_state(svc)
        log.warning("event=drain idle=%s state=%s transfer_id=%s reason=%r", state["idle"], state["state"], state["transfer_id"],
                    state["reason"])
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
        found = svc.slot.cancel(body.transfer_id, body.fence)
        log.info("event=cancel transfer_id=%s fence=%s found=%s", body.transfer_id, body.fence, found)
        return {"transfer_id": body.transfer_id, "cancelled": found}

    @app.post("/v1/reserve")
    async def reserve(body: ReserveBody) -> Any:
        return reservations.reserve(svc, body, secret)

    @app.post("/v1/renew")
    async def renew(body: RenewBody) -> Any:
        return reservations.renew(svc, body)

    @app.get("/v1/slot")
    async def slot(wait_s: float = 0.0) -> dict:
        return await reservations.slot_view(svc, slot_free, wait_s)

    @app.post("/v1/decode")
    async def decode(body: DecodeBody, request: Request):  # noqa: ANN202 - JSON or a stream
        return await serve_decode(svc, body, request, secret)

    return app
