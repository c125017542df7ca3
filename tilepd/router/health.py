"""Health checks of decode nodes: the circuit breaker's eyes.

Every interval each node's `/health` is read; a node failing `breaker_failures` checks
(or calls) in a row leaves rotation, and the first passing check brings it back, after
re-reading its `/capabilities` (a restarted node may run a different engine build).
"""

from __future__ import annotations

import asyncio
import logging

from tilepd.router.leases import NodeState
from tilepd.router.state import RouterState
from tilepd.router.upstream import UpstreamError

log = logging.getLogger("tilepd.router")
PROBE_TIMEOUT_S = 1.0


async def probe_node(state: RouterState, node: NodeState) -> None:
    client = state.client
    try:
        resp = await client.request("GET", f"{node.base_url}/health", timeout_s=PROBE_TIMEOUT_S)
        healthy = resp.status == 200
        why = f"/health answered {resp.status}"
        if healthy and (node.capabilities is None or not node.in_rotation):
            caps = await client.request("GET", f"{node.base_url}/capabilities", timeout_s=PROBE_TIMEOUT_S)
            if caps.status != 200:
                raise ValueError(f"/capabilities answered {caps.status}")
            node.capabilities = caps.json()
    except UpstreamError as exc:
        healthy, why = False, str(exc)
    except ValueError as exc:
        healthy, why = False, f"{type(exc).__name__}: {exc}"
    if healthy:
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
