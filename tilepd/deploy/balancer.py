"""The load balancer in front of the routers, as `tilepd` reads and drives it: each router's state on HAProxy's stats
page, and a router's drain for a rolling restart.

HAProxy's CSV stats (`<stats_url>;csv`) have one row per router (`pxname` the backend, `svname` the router's name) with
its `status`: `UP`, `DOWN`, `MAINT`, `DRAIN`, `NOLB`, or a transition like `UP 1/2` (going down) and `DOWN 1/2` (coming
up); `no check` when checks are off. A router takes new requests while it is `UP` (also `UP 1/2`, on its way down).

A rolling restart of a router (tilepd/deploy/proc.py): `drain` it (its /health answers 503, tilepd/router/drain.py),
wait until the balancer marks it out (`wait_state`), wait until its requests in flight end (`wait_idle`, bounded), then
restart it, gate on its health, and wait until the balancer marks it `UP` again. Only urllib is used: the supervisor
imports no httpx on the hosts.
"""

from __future__ import annotations

import csv
import io
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from tilepd.auth import node_auth_header

POLL_S = 0.2


def takes_new(state: str) -> bool:
    """Whether the balancer sends a router in this state new requests (`UP`, `UP 1/2` going down, `no check`)."""
    return state.startswith("UP") or state == "no check"


class BalancerSpec(BaseModel):
    """Where a router sits behind the balancer (a router's ServiceSpec carries it for its rolling restart)."""

    model_config = ConfigDict(extra="forbid")

    stats_url: str | None  # None: an operator-run balancer whose state tilepd cannot read (waits its checks' pace instead)
    backend: str
    server: str  # the router's name on the balancer
    check_interval_s: float
    checks_to_mark: int  # failed (or passing) checks in a row before the balancer takes a router out (or puts it back)
    drain_timeout_s: float


class BalancerError(Exception):
    """The balancer or a router did not answer as a drain needs (the message says which and why)."""


def _get(url: str | urllib.request.Request, timeout_s: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (URLs come from the plan)
        return resp.read(1 << 20)


def backend_states(stats_url: str, backend: str, timeout_s: float = 5.0) -> dict[str, str]:
    """Router name -> its state on the balancer (HAProxy's `status` column)."""
    try:
        text = _get(stats_url + ";csv", timeout_s).decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        raise BalancerError(f"the balancer's stats {stats_url} did not answer: {exc}") from None
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return {r["svname"]: r["status"] for r in rows if r.get("pxname") == backend and r.get("svname") not in ("FRONTEND", "BACKEND")}


def wait_state(spec: BalancerSpec, taking_new: bool, timeout_s: float, now: Callable[[], float] = time.monotonic) -> str:
    """Wait until the balancer sends the router new requests (`taking_new`) or no longer does; its last state. Raises
    BalancerError when it did not come to that within `timeout_s`. An operator-run balancer (no stats) is given the time
    its health checks take to notice (`fall`/`rise` checks and one more)."""
    if spec.stats_url is None:
        time.sleep((spec.checks_to_mark + 1) * spec.check_interval_s)
        return "unknown (external balancer)"
    deadline = now() + timeout_s
    state = "?"
    while True:
        try:
            state = backend_states(spec.stats_url, spec.backend).get(spec.server, "absent")
        except BalancerError:
            state = "stats unreachable"
        if state not in ("stats unreachable", "absent") and takes_new(state) == taking_new and (not taking_new or state == "UP"):
            return state
        if now() >= deadline:
            raise BalancerError(f"the balancer still shows router {spec.server} as {state!r} after {timeout_s:g} s "
                                f"(waited for it to be {'UP' if taking_new else 'out'})")
        time.sleep(POLL_S)


def _post(url: str, secret: bytes | None, timeout_s: float = 5.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=b"", method="POST", headers=node_auth_header(secret))  # noqa: S310 (the plan's URLs)
    try:
        return json.loads(_get(req, timeout_s) or b"{}")
    except urllib.error.HTTPError as exc:
        raise BalancerError(f"{url} answered {exc.code}: {exc.read(300).decode('utf-8', 'replace')}") from None
    except (OSError, ValueError) as exc:
        raise BalancerError(f"{url} did not answer: {exc}") from None


def drain_router(base_url: str, secret: bytes | None) -> dict[str, Any]:
    """POST /admin/drain on the router: its /health answers 503 from now on."""
    return _post(f"{base_url}/admin/drain", secret)


def undrain_router(base_url: str, secret: bytes | None) -> dict[str, Any]:
    return _post(f"{base_url}/admin/undrain", secret)


def in_flight(base_url: str, timeout_s: float = 5.0) -> int:
    """The router's requests in flight, from its /health (200, or 503 while draining)."""
    try:
        raw = _get(f"{base_url}/health", timeout_s)
    except urllib.error.HTTPError as exc:
        raw = exc.read(65536)
    except (OSError, ValueError) as exc:
        raise BalancerError(f"{base_url}/health did not answer: {exc}") from None
    try:
        return int(json.loads(raw)["in_flight"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BalancerError(f"{base_url}/health says nothing of its requests in flight ({exc}): a router before tilepd's drain?") from None


def wait_idle(base_url: str, timeout_s: float, now: Callable[[], float] = time.monotonic) -> int:
    """Wait until the router has no request in flight, at most `timeout_s`; the requests left (0: idle)."""
    deadline = now() + timeout_s
    while True:
        left = in_flight(base_url)
        if left == 0 or now() >= deadline:
            return left
        time.sleep(POLL_S)
