"""What a running router holds: config, upstream client, tokenizer, node pool, metrics, background tasks."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from tilepd.auth import node_auth_header
from tilepd.contracts.service_configs import RouterConfig
from tilepd.router.auth import ApiKeys
from tilepd.router.drain import DrainState
from tilepd.router.leases import NodePool
from tilepd.router.loop_lag import LoopLag
from tilepd.router.metrics import RouterMetrics
from tilepd.router.prompts import PromptRenderer
from tilepd.router.upstream import Upstream


@dataclass
class RouterState:
    config: RouterConfig
    client: Upstream
    renderer: PromptRenderer
    pool: NodePool
    metrics: RouterMetrics
    keys: ApiKeys
    # the deployment secret (tilepd.auth): transfer tokens and decode-node credentials derive from it
    node_secret: bytes | None = None
    tracing: Any = None  # tilepd.router.tracing.Tracing when an OTLP collector is configured
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    loop_lag: LoopLag = field(default_factory=LoopLag)  # the router's own hold-ups: a timeout across one says nothing
    watch: Any = None  # tilepd.router.divergence_watch.DivergenceWatch (set by the app)
    identity: str = "router"  # who holds a node's slot, as the node tells another router (reservations.router_identity)
    drain: DrainState = field(default_factory=DrainState)  # a rolling restart's drain behind the balancer (drain.py)
    # node name -> the long-poll waiting for that node's slot to be free while another router holds it (reservations.py)
    slot_watches: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    _prefill_cycle: Any = None
    _native_prefill_cycle: Any = None
    _native_decode_cycle: Any = None

    def __post_init__(self) -> None:
        self._prefill_cycle = itertools.cycle(self.config.prefill_urls or ("",))
        native = self.config.native_pool
        self._native_prefill_cycle = itertools.cycle(native.prefill_urls if native else ("",))
        self._native_decode_cycle = itertools.cycle(native.decode_urls if native else ("",))

    @property
    def node_headers(self) -> dict[str, str]:
        """Headers of a mutating call on a decode node ({} in an unauthenticated dev run)."""
        return node_auth_header(self.node_secret)

    def next_prefill_url(self) -> str:
        return str(next(self._prefill_cycle)).rstrip("/")

    def next_native_urls(self) -> tuple[str, str]:
        return str(next(self._native_prefill_cycle)).rstrip("/"), str(next(self._native_decode_cycle)).rstrip("/")

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run work that must finish even if the request that started it is cancelled (lease returns)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task
