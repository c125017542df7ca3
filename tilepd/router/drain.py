"""A router's drain, for a rolling restart behind the balancer: it takes no new request from the balancer while the
ones it serves end.

`POST /admin/drain` (the deployment's key, as a decode node's admin calls) turns `/health` into 503
`{"status": "draining", "in_flight": N}`: the balancer's health checks take the router out (tilepd/plan/haproxy.py)
and send new requests to the other routers, while this one goes on serving whatever still reaches it and streaming
what it serves. `in_flight` counts the OpenAI requests (`/v1/...`) from their first byte in to their last byte out,
so a restart can wait until it is 0. `POST /admin/undrain` undoes it; a restarted router starts undrained.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("tilepd.router")

COUNTED_PREFIX = "/v1/"


class InFlight:
    """ASGI middleware counting the requests under COUNTED_PREFIX in progress (a stream counts until its end)."""

    def __init__(self, app: ASGIApp, counter: "DrainState") -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(COUNTED_PREFIX):
            await self.app(scope, receive, send)
            return
        self.counter.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.in_flight -= 1


class DrainState:
    """Whether the router is draining, and its requests in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0

    def set(self, draining: bool) -> dict[str, object]:
        if draining != self.draining:
            log.warning("event=%s in_flight=%d", "router_draining" if draining else "router_undrained", self.in_flight)
        self.draining = draining
        return self.view()

    def view(self) -> dict[str, object]:
        return {"draining": self.draining, "in_flight": self.in_flight, "idle": self.in_flight == 0}
