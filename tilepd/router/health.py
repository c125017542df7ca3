"""Health checks of decode nodes: the circuit breaker's eyes.

Every interval each node's `/health` is read; a node failing `breaker_failures` checks
(or calls) in a row leaves rotation, and the first passing check brings it back, after
re-reading its `/capabilities` (a restarted node may run a different engine build).

A node whose `/health` answers 503 `{"status": "draining"}` is alive: its breaker stays
closed (its in-flight request is not failed over) but it is leased no more from this
check on; the first 200 makes it leasable again.

A check that timed out while the router's own loop was held up for a good part of it
(loop_lag.py) counts neither way, up to `MAX_UNJUDGED` in a row: the router was not
running to hear the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tilepd.contracts.decode_http import NODE_API_VERSION
from tilepd.contracts.fingerprint import Fingerprint
from tilepd.router.leases import NodeState
from tilepd.router.state import RouterState
from tilepd.router.upstream import UpstreamError, UpstreamResponse

log = logging.getLogger("tilepd.router")

# timed-out checks in a row not held against a node while the router was held up; the next one counts: a router that
# is always held up must still take a dead node out of rotation
MAX_UNJUDGED = 3


def says_draining(resp: UpstreamResponse) -> bool:
    """A decode node's `/health` that answers 503 draining: alive, finishing its request, taking no new one."""
    if resp.status != 503:
        return False
    try:
        body = resp.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("status") == "draining"


def note_draining(state: RouterState, node: NodeState, draining: bool, why: str) -> None:
    """Stop or resume leasing a node; logged once per change."""
    if state.pool.set_draining(node, draining):
        log.warning("event=%s node=%s why=%s", "node_draining" if draining else "node_undrained", node.name, why)


def _restarted_onto_other_weights(resp: UpstreamResponse, node: NodeState) -> bool:
    """The node's /health names another fingerprint than its cached /capabilities (a restart within one check)."""
    if resp.status != 200:
        return False
    try:
        seen = resp.json().get("fingerprint")
        known = (node.capabilities or {}).get("fingerprint")
        return seen is not None and (known is None or Fingerprint.model_validate(known).id != seen)
    except (ValueError, AttributeError):
        return False


async def probe_node(state: RouterState, node: NodeState) -> None:
    client = state.client
    draining, timed_out, started = False, False, time.monotonic()
    try:
        resp = await client.request("GET", f"{node.base_url}/health", timeout_s=state.config.health_timeout_s)
        draining = says_draining(resp)
        healthy = resp.status == 200 or draining
        why = f"/health answered {resp.status}"
        if healthy and (node.capabilities is None or not node.in_rotation or _restarted_onto_other_weights(resp, node)):
            caps = await client.request("GET", f"{node.base_url}/capabilities", timeout_s=state.config.health_timeout_s)
            if caps.status != 200:
                raise ValueError(f"/capabilities answered {caps.status}")
            node.capabilities = caps.json()
            api = node.capabilities.get("node_api", 1) if isinstance(node.capabilities, dict) else None
            if api != NODE_API_VERSION:  # it could not arbitrate its slot between routers: never lease it
                node.capabilities = None
                raise ValueError(f"the decode node speaks node API {api}, this router {NODE_API_VERSION}: upgrade "
                                 f"{'the decode node' if (api or 0) < NODE_API_VERSION else 'the router'} to the same tilepd")
    except UpstreamError as exc:
        healthy, why, timed_out = False, str(exc), isinstance(exc.cause, TimeoutError)
    except ValueError as exc:
        healthy, why = False, f"{type(exc).__name__}: {exc}"
    now = time.monotonic()
    if not healthy and timed_out and node.unjudged_probes < MAX_UNJUDGED and not state.loop_lag.judges(started, now - started, now):
        node.unjudged_probes += 1
        log.warning("event=probe_inconclusive node=%s router_held_up_s=%.2f of_s=%.2f why=%s", node.name,
                    state.loop_lag.stalled_s(started, now), now - started, why)
        return
    node.unjudged_probes = 0
    if healthy:
        note_draining(state, node, draining, why if draining else "/health answered 200")
        state.metrics.node_ok(state.pool, node)
    else:
        state.metrics.node_failure(state.pool, node, why)


async def probe_all(state: RouterState) -> None:
    await asyncio.gather(*(probe_node(state, n) for n in state.pool.nodes))


async def probe_forever(state: RouterState, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await probe_all(state)
        except Exception as exc:  # a bug here must not stop health checking
            log.exception("event=probe_error error=%r", exc)
