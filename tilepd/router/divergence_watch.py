"""The divergence watch: while the router serves, check that decode nodes still decode what the prefill's model would.

A node can go wrong with every health check green: weights converted from another checkpoint (the fingerprint
catches that at the hello), but also a bad kernel, a corrupted upload, an engine upgrade that changed numerics. The
watch checks nodes' greedy tokens the way the canary of `tilepd up` does (teacher-forced verification,
tilepd.contracts.teacher_forced): the prefill pool scores prompt + tokens in one pass and every token must be the
prefill's top-1 or within `margin_nats` of it.

What is checked, one check at a time, off the request path:
- a `sample_rate` share of the completed greedy low-latency requests (temperature 0, no structured-output
  constraint, served by one node from start to end, prompt + tokens within `max_context_tokens`); `Call.finished`
  offers each request, which costs a random draw, and a copy of its token ids when it is sampled;
- a request whose client asked for it (header `x-tilepd-verify: 1`), whatever the rate: the demo and `tilepd up`'s
  router canary read its verdict from the router's `/status` (`divergence.recent`, by request id);
- a probe of each node no check reached for `interval_s`, when the node is free and no request waits (a greedy
  request of `probe_tokens` tokens on a fixed pseudo-random prompt, through the same prefill + node path), so an
  idle node is checked too; a node whose check diverged is probed again at once.

A node with `diverged_checks` diverged checks in a row is drained through its admin API with the reason (its
`/health`, `/status` and `tilepd status` say why; it stays out across restarts until `tilepd undrain`, and for every
router), and this router stops leasing it at once. Per node, `/metrics` counts checks by verdict and keeps the worst
gap of the last one; `/status` has the counts, the last verdict and the recent checks. Runbook RB-divergence.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tilepd.contracts.service_configs import DivergenceWatchConfig
from tilepd.contracts.teacher_forced import ScoringError, Verdict, judge, scores_from_vllm, scoring_request
from tilepd.router.leases import Lease, NodeState
from tilepd.router.lowlatency import EnginePlan, LowLatencyRun
from tilepd.router.reservations import try_lease_node
from tilepd.router.state import RouterState
from tilepd.router.upstream import UpstreamError
from tilepd.runbooks import see, tag

log = logging.getLogger("tilepd.router")

VERIFY_HEADER = "x-tilepd-verify"
RECENT_CHECKS = 64  # verdicts kept for /status
MAX_TICK_S = 5.0  # how often the loop looks for nodes due for a probe, at most
PROBE_PROMPT_TOKENS = 16
PROBE_FIRST_ID = 100  # probe prompts draw ids from [PROBE_FIRST_ID, vocabulary): ordinary tokens of any vocabulary
SCORE_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 5.0

Source = Literal["request", "asked", "probe"]


@dataclass
class Sample:
    """One node's greedy tokens after a prompt, waiting for the prefill's scores."""

    request_id: str
    node: str
    prompt: list[int]
    tokens: list[int]
    source: Source


@dataclass
class NodeRecord:
    """What the watch knows of one node."""

    checks: int = 0
    diverged: int = 0
    errors: int = 0
    in_a_row: int = 0  # diverged checks in a row
    last_check: float | None = None  # the watch's clock at the last check (None: never checked)
    probe_now: bool = False  # a diverged check asks for a probe at once
    last: dict[str, Any] | None = None  # the last verdict (Verdict.as_json) or error
    drained: str | None = None  # the reason the watch drained it
    drain_failed: bool = False  # the node's admin API did not take the drain: the watch keeps it out here itself

    def as_json(self) -> dict[str, Any]:
        return {"checks": self.checks, "diverged": self.diverged, "errors": self.errors, "diverged_in_a_row": self.in_a_row,
                "last": self.last, "drained": self.drained}


def eligible(run: LowLatencyRun) -> str | None:
    """Why a finished request cannot be judged by the rule (None: it can)."""
    plan = run.plan
    if plan.temperature > 0 and plan.top_k != 1:
        return "sampled (temperature > 0): its tokens are not meant to be the top-1"
    if plan.structured is not None:
        return "decoded under a structured-output constraint the prefill's scores do not see"
    if run.failovers:
        return "served by more than one node"
    if len(run.tokens) < 2:
        return "no token from the node"
    return None


def probe_prompt(seed: int, vocab_size: int) -> list[int]:
    """A fixed pseudo-random prompt per seed, of ordinary token ids."""
    rng = random.Random(seed)
    high = max(vocab_size, PROBE_FIRST_ID + 2)
    return [rng.randrange(PROBE_FIRST_ID, high) for _ in range(PROBE_PROMPT_TOKENS)]


@dataclass
class DivergenceWatch:
    state: RouterState
    config: DivergenceWatchConfig
    draw: Callable[[], float] = random.random
    clock: Callable[[], float] = time.monotonic
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT_CHECKS))
    dropped: int = 0  # sampled requests the full queue could not take
    _queue: asyncio.Queue[Sample] | None = None
    _probes: int = 0

    def __post_init__(self) -> None:
        # the first probe of a node comes an interval after the start (a router's start is busy enough)
        self.nodes = {n.name: NodeRecord(last_check=self.clock()) for n in self.state.pool.nodes}

    @property
    def queue(self) -> asyncio.Queue[Sample]:
        if self._queue is None:
            self._queue = asyncio.Queue(maxsize=self.config.queue_size)
        return self._queue

    # -- the request path: cheap ---------------------------------------------------------------------------------
    def offer(self, run: LowLatencyRun, asked: bool) -> None:
        """A low-latency request finished well: queue it for a check when it is sampled or its client asked."""
        if not self.config.enabled or (not asked and self.draw() >= self.config.sample_rate):
            return
        why = eligible(run)
        node = run.lease.node.name
        if why is None and len(run.plan.prompt_ids) + min(len(run.tokens), self.config.max_checked_tokens) > self.config.max_context_tokens:
            why = f"longer than max_context_tokens {self.config.max_context_tokens}"
        if why is not None:
            if asked:
                self._remember(run.request_id, node, "asked", {"checked": False, "summary": f"not checked: {why}"})
            return
        sample = Sample(run.request_id, node, list(run.plan.prompt_ids), list(run.tokens[:self.config.max_checked_tokens]),
                        "asked" if asked else "request")
        try:
            self.queue.put_nowait(sample)
        except asyncio.QueueFull:
            self.dropped += 1

    # -- the watch loop ------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Check queued samples one at a time; between them, probe the nodes that are due."""
        tick = min(self.config.interval_s / 4, MAX_TICK_S)
        while True:
            try:
                sample: Sample | None = await asyncio.wait_for(self.queue.get(), timeout=tick)
            except TimeoutError:
                sample = None
            try:
                if sample is not None:
                    await self.check(sample)
                await self.probe_due()
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the watch
                log.exception("event=divergence_watch_error error=%r", exc)

    async def probe_due(self) -> None:
        now = self.clock()
        for node in self.state.pool.nodes:
            rec = self.nodes.setdefault(node.name, NodeRecord())
            self._follow_operator(node, rec)
            due = rec.probe_now or rec.last_check is None or now - rec.last_check >= self.config.interval_s
            if not due or rec.drained is not None:
                continue
            plan = self._probe_plan()  # before the lease: nothing between the lease and the run can fail
            lease = await try_lease_node(self.state, node)  # reserved on the node, as a request's (node API 2)
            if lease is None:
                continue
            sample = await self.probe(lease, plan)
            if sample is not None:
                await self.check(sample)
            else:
                rec.last_check, rec.probe_now = self.clock(), False  # try again next interval, not at every tick

    def _follow_operator(self, node: NodeState, rec: NodeRecord) -> None:
        """A drained node an operator took back (undrained: in rotation again) starts with a clean record; one whose
        drain the node did not take stays out of this router's rotation."""
        if rec.drained is None:
            return
        if rec.drain_failed:
            self.state.pool.set_draining(node, True)
        elif node.in_rotation and not node.draining:
            log.info("event=divergence_watch_reset node=%s why=undrained", node.name)
            self.nodes[node.name] = NodeRecord(last_check=self.clock())

    def _probe_plan(self) -> EnginePlan:
        """The next probe's greedy request of `probe_tokens` on a fixed pseudo-random prompt."""
        self._probes += 1
        prompt = probe_prompt(self._probes, len(self.state.renderer.tokenizer))
        return EnginePlan(prompt_ids=prompt, max_tokens=self.config.probe_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                          stop=[], include_stop_str_in_output=False, stop_token_ids=[], ignore_eos=True, skip_special_tokens=True)

    async def probe(self, lease: Lease, plan: EnginePlan) -> Sample | None:
        """`plan` through the prefill and this node (the lease, reserved on the node, is the run's to return)."""
        rid = f"divergence-probe-{uuid.uuid4().hex[:12]}"
        run = LowLatencyRun(self.state, plan, lease, rid)
        node = lease.node.name
        prompt = plan.prompt_ids
        try:
            async for _ in run.events():
                pass
        except Exception as exc:  # noqa: BLE001 - a failed probe says nothing about divergence: the next one may tell
            log.warning("req=%s event=divergence_probe_failed node=%s error=%s", rid, node, f"{type(exc).__name__}: {exc}"[:300])
            return None
        if run.failovers:
            return None
        return Sample(rid, node, prompt, list(run.tokens), "probe")

    async def check(self, sample: Sample) -> Verdict | None:
        """Score the sample with the prefill pool and record the verdict (None: it could not be scored)."""
        url = self.state.next_prefill_url()
        body = scoring_request(self.state.config.served_model_name, sample.prompt, sample.tokens)
        rec = self.nodes.setdefault(sample.node, NodeRecord())
        rec.last_check, rec.probe_now = self.clock(), False
        try:
            resp = await self.state.client.request("POST", f"{url}/v1/completions", body=body,
                                                   headers={"x-request-id": f"{sample.request_id}-verify"}, timeout_s=SCORE_TIMEOUT_S)
            if resp.status != 200:
                raise ScoringError(f"{url} answered {resp.status}: {resp.content[:200].decode('utf-8', 'replace')}")
            # a long prompt's logprobs are hundreds of KB of JSON: parsed off the event loop
            verdict = await asyncio.to_thread(_verdict, resp.content, len(sample.prompt), sample.tokens, self.config.margin_nats)
        except (UpstreamError, ScoringError, ValueError) as exc:
            rec.errors += 1
            self.state.metrics.divergence_checks.labels(sample.node, "error").inc()
            error = f"{type(exc).__name__}: {exc}"[:300]
            rec.last = {"checked": False, "summary": f"the prefill could not score it: {error}"}
            self._remember(sample.request_id, sample.node, sample.source, rec.last)
            log.warning("req=%s event=divergence_check node=%s source=%s verdict=error error=%s", sample.request_id, sample.node,
                        sample.source, error)
            return None
        await self._record(sample, rec, verdict)
        return verdict

    async def _record(self, sample: Sample, rec: NodeRecord, verdict: Verdict) -> None:
        rec.checks += 1
        rec.last = {"checked": True, **verdict.as_json()}
        self._remember(sample.request_id, sample.node, sample.source, rec.last)
        self.state.metrics.divergence_checks.labels(sample.node, "agree" if verdict.ok else "diverged").inc()
        self.state.metrics.divergence_worst_gap.labels(sample.node).set(verdict.worst_gap)
        if verdict.ok:
            rec.in_a_row = 0
            log.info("req=%s event=divergence_check node=%s source=%s verdict=agree tokens=%d worst_gap=%.3f", sample.request_id,
                     sample.node, sample.source, verdict.checked, verdict.worst_gap)
            return
        rec.diverged += 1
        rec.in_a_row += 1
        rec.probe_now = True  # confirm (or clear) it now rather than in an interval
        log.warning("req=%s event=divergence_check node=%s source=%s verdict=diverged in_a_row=%d %s summary=%s", sample.request_id,
                    sample.node, sample.source, rec.in_a_row, tag("RB-divergence"), verdict.describe())
        if rec.in_a_row >= self.config.diverged_checks and rec.drained is None:
            await self._drain(sample.node, rec, verdict)

    async def _drain(self, name: str, rec: NodeRecord, verdict: Verdict) -> None:
        """Out of rotation everywhere: drained through the node's admin API with the reason, and leased no more here."""
        reason = (f"divergence watch: {rec.in_a_row} checks in a row diverged from the prefill; last "
                  f"{verdict.describe()}")[:480]
        rec.drained = reason
        node = next((n for n in self.state.pool.nodes if n.name == name), None)
        if node is None:
            return
        self.state.pool.set_draining(node, True)
        try:
            resp = await self.state.client.request("POST", f"{node.base_url}/admin/drain", body={"reason": reason},
                                                   headers=self.state.node_headers, timeout_s=DRAIN_TIMEOUT_S)
            rec.drain_failed = resp.status != 200
            detail = f"HTTP {resp.status}"
        except UpstreamError as exc:
            rec.drain_failed, detail = True, str(exc)
        log.warning("event=node_diverged node=%s drained=%s %s reason=%s%s", name, "node" if not rec.drain_failed else f"router_only({detail})",
                    tag("RB-divergence"), reason, see("RB-divergence"))

    def _remember(self, request_id: str, node: str, source: Source, verdict: dict[str, Any]) -> None:
        self.recent.append({"request_id": request_id, "node": node, "source": source, "at": round(time.time(), 3), "verdict": verdict})

    def status(self) -> dict[str, Any]:
        c = self.config
        return {"enabled": c.enabled, "sample_rate": c.sample_rate, "interval_s": c.interval_s, "margin_nats": c.margin_nats,
                "diverged_checks": c.diverged_checks, "queued": self.queue.qsize(), "dropped": self.dropped,
                "nodes": {name: rec.as_json() for name, rec in self.nodes.items()}, "recent": list(self.recent)}


def _verdict(content: bytes, prompt_len: int, tokens: list[int], margin: float) -> Verdict:
    try:
        body = json.loads(content)
    except ValueError as exc:
        raise ScoringError(f"the prefill's answer is not JSON: {exc}") from None
    return judge(scores_from_vllm(body, prompt_len, tokens), margin)


def asked_to_verify(headers: Any) -> bool:
    """The client's `x-tilepd-verify` header asks for a check of this request."""
    return str(headers.get(VERIFY_HEADER, "")).strip().lower() in ("1", "true", "yes")
