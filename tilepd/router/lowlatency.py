"""The low-latency flow: prefill on vLLM with the router's marker, then stream from a leased decode node.

One `LowLatencyRun` per request. Its `events()` yields text deltas and one `Finished`;
whatever way the request ends (finished, stop string, error, client gone, shutdown),
the node is returned to the pool only once it is idle again, in a background task so
that a cancelled request cannot skip it.

A request survives its decode node (README, "Decode-node faults"). Each node the request
uses is one `NodeAttempt`. When the node refuses the connection, resets it, or goes
silent past a deadline (below), or the health checks take it out of rotation while the
request waits on it, the node leaves rotation at once and the request continues on
another node: prompt + the tokens already sent are prefilled again with that node's
marker, vLLM samples the next token, and the new node decodes the rest. Detokenizer,
stop-string matcher and token count are the request's, not the attempt's, so the
client sees one stream, token-exact for greedy requests. When no node can take it,
the request ends with a typed error (an error event in a stream), never truncated.

Deadlines (s), with `step` the node's measured time per token (`DEFAULT_STEP_S` before
the first measure):
- first token: KV_WAIT_S + FIRST_TOKEN_STEPS * step + DEADLINE_SLACK_S. The router asks
  every node to wait KV_WAIT_S for the KV (`kv_timeout_s`; the node answers 504 then, by
  itself); past that plus a few steps the node itself must be stuck.
- each later token: STALL_STEPS * step + DEADLINE_SLACK_S, counted only while the router
  waits on the node (a slow client does not count against the node).
- node out of rotation (health checks): OUT_OF_ROTATION_GRACE_S of silence.
- liveness: after LIVENESS_AFTER_S of silence the router probes the node's /health every
  LIVENESS_INTERVAL_S; LIVENESS_MISSES failed probes in a row (a stopped or wedged
  process) end the wait long before the deadline. A node that answers its probes is
  slow, not dead, and is given the full deadline.
- time the router itself was held up (its loop got no CPU: loop_lag.py) counts toward
  neither the deadlines nor a probe's miss: a node is not blamed for the router's stall.
- a request whose node failed goes on from another node, else the native pool; with
  neither (no node in rotation, no native pool) it waits up to REJOIN_WAIT_S for a node
  to come back into rotation (the frozen one, once it answers again) and goes on there.

The node is reserved on the node itself before the prefill (reservations.py: a lease renewed while the request
holds it). A renewal the node refuses (the lease ran out while this router was cut off or held up) trips the
watchdog as `reservation_lost`: the node is alive and another request holds it, so the request goes on elsewhere
and the node stays in rotation.

Freeing the node when no decode will follow (INTERFACES §4 as the decode server
implements it):
- first token already final (EOS, stop token/string, max_tokens=1): the connector has
  sent, or is still sending, the KV and its `admit` holds the slot. The router joins
  that transfer with a throw-away `/v1/decode` (max_tokens 1, not streamed) after the
  client has its answer: the node waits for the KV, decodes one step, frees the slot.
  A bare `/v1/cancel` would race the admit: arriving first, it finds nothing to cancel,
  and the admit then holds the slot until the node's orphan timeout.
- prefill interrupted (client gone, router stopping): the same join, with a short KV
  timeout, since the admit may or may not come.
- prefill refused by vLLM (an error response): nothing reached the connector; `/v1/cancel` ends the
  reservation (and any late KV for it is refused), then release.
- decoding: `/v1/cancel`, close the stream, wait until `/status` shows the node idle.
- node faulted: a best-effort `/v1/cancel`, then release (the node is out of rotation;
  its own KV timeout frees the slot if it comes back).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tilepd.contracts.decode_http import DecodeBody
from tilepd.contracts.marker import NODE_FINGERPRINT_KEY, TilepdMarker
from tilepd.router.backends import (
    DecodeNodeError,
    ReadWatch,
    cancel_decode,
    decode_lines,
    join_decode,
    node_alive,
    node_status,
    open_decode,
    prefill_first_token,
)
from tilepd.router.detok import make_detokenizer
from tilepd.router.errors import PassThroughError, RouterError, invalid
from tilepd.router.leases import Lease, LeaseTimeout, NoNodeInRotation
from tilepd.router.logprobs import TokenLogprob, from_node, from_prefill
from tilepd.router.native_continue import native_tokens
from tilepd.router.reservations import RESERVATION_LOST, Reservation, end_renewal, lease_node
from tilepd.router.state import RouterState
from tilepd.router.stops import StopStringMatcher
from tilepd.router.structured import StructuredPlan
from tilepd.router.timeline import Timeline
from tilepd.router.upstream import UpstreamStream

log = logging.getLogger("tilepd.router")

BUSY_RETRY_S = 1.0  # a node that still finishes its last request answers busy for a moment
IDLE_WAIT_S = 5.0  # how long a cancelled node may take to report idle before the lease is returned anyway
# decode-node answers after which the node has freed the slot itself (504 KV timeout, 499 cancelled, 502 transfer failed,
# 410 the reservation's lease ran out)
NODE_FREED_SLOT = frozenset({410, 499, 502, 504})
JOIN_KV_TIMEOUT_S = 10.0  # a join after a finished prefill: the KV is on its way
JOIN_INTERRUPTED_KV_TIMEOUT_S = 3.0  # a join after an interrupted prefill: the KV may never come
FAULT_CANCEL_TIMEOUT_S = 1.0
# deadlines (module docstring)
KV_WAIT_S = 30.0
FIRST_TOKEN_STEPS = 8
STALL_STEPS = 50
DEADLINE_SLACK_S = 5.0
DEFAULT_STEP_S = 0.5
OUT_OF_ROTATION_GRACE_S = 1.0
# a node the router has waited on this long is asked GET /health; this many failed probes in a row in one wait: silent
LIVENESS_AFTER_S = 1.0
LIVENESS_INTERVAL_S = 0.5
# 2 s and 3 misses: a node that stalls for a few seconds on a loaded CPU host (probes of 1 s, 2 misses, tripped after
# ~3 s) is given ~9 s before it is called stopped, still far inside the first-token deadline (RELIABILITY.md).
LIVENESS_PROBE_TIMEOUT_S = 2.0
LIVENESS_MISSES = 3
# a request that lost its node with no other node in rotation and no native pool waits this long for one to come back
# (a node that froze for tens of seconds on a loaded host, then answers its health checks again) before it fails
REJOIN_WAIT_S = 30.0
# decode-node answers before the first token that another node may not give: continue elsewhere (node stays in rotation)
RETRY_ELSEWHERE = frozenset({410, 429, 502, 503, 504})


@dataclass(frozen=True)
class EnginePlan:
    """A request reduced to what prefill and the decode engine take (after templating and defaults)."""

    prompt_ids: list[int]
    max_tokens: int  # counts the first token, which prefill samples
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    include_stop_str_in_output: bool
    stop_token_ids: list[int]
    ignore_eos: bool
    skip_special_tokens: bool
    logprobs: int | None = None  # top-n logprobs per token (0: the sampled token's only); None: not asked
    structured: StructuredPlan | None = None  # response_format: to the prefill as asked, to the node as a constraint


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens consumed since the last delta (when asked)
    tokens: tuple[int, ...] = ()  # the token ids consumed since the last delta (vLLM's tool parsers read them)


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    stop_reason: str | int | None
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    failovers: int = 0


class HandoffRefused(RouterError):
    """The prefill's connector refused to hand this request's KV to the node (`tilepd_handoff` state refused): no
    KV will come, so the node is not asked to wait for it (it would, KV_WAIT_S); the request goes native or fails."""

    def __init__(self, node: str, reason: str) -> None:
        super().__init__(502, f"the prefill refused the hand-off to decode node {node}: {reason}"[:1000], type="prefill_error",
                         code="handoff_refused")
        self.node = node
        self.reason = reason


class NodeFault(Exception):
    """The decode node failed this request; `down`: it is dead or silent (out of rotation at once)."""

    def __init__(self, error: DecodeNodeError, down: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.down = down


class _TextState:
    """Token ids in, safe-to-send text out; decides when the request is finished. Survives a change of node."""

    def __init__(self, plan: EnginePlan, state: RouterState) -> None:
        self.plan = plan
        self.detok = make_detokenizer(state.renderer.tokenizer, plan.prompt_ids, plan.skip_special_tokens)
        self.stops = StopStringMatcher(plan.stop, plan.include_stop_str_in_output)
        self.stop_ids = frozenset(plan.stop_token_ids)
        self.terminators = self.stop_ids if plan.ignore_eos else self.stop_ids | state.renderer.eos_token_ids
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.pending_logprobs: list[TokenLogprob] = []
        self._tokens_taken = 0

    @property
    def count(self) -> int:
        return len(self.tokens)

    def take_tokens(self) -> tuple[int, ...]:
        out = tuple(self.tokens[self._tokens_taken:])
        self._tokens_taken = len(self.tokens)
        return out

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        out = tuple(self.pending_logprobs)
        self.pending_logprobs.clear()
        return out

    def consume(self, token: int, logprob: TokenLogprob | None = None) -> str:
        """Account one generated token; return the text now safe to send."""
        self.tokens.append(token)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        if token in self.terminators:
            # like vLLM: the stop token's own text is left out unless asked for
            if self.plan.include_stop_str_in_output:
                self.stops.feed(self.detok.add(token))
            self.finish_reason = "stop"
            self.stop_reason = token if token in self.stop_ids else None
        else:
            hit = self.stops.feed(self.detok.add(token))
            if hit is not None:
                self.finish_reason, self.stop_reason = "stop", hit.stop
            elif self.count >= self.plan.max_tokens:
                self.finish_reason = "length"
        return self.stops.sendable(self.finish_reason is not None)


class NodeAttempt(ReadWatch):
    """One decode node's part of a request: its lease and transfer, how far it got, and its watchdog."""

    def __init__(self, state: RouterState, lease: Lease, request_id: str, context_len: int) -> None:
        self.state = state
        self.lease = lease
        self.request_id = request_id
        self.context_len = context_len  # tokens whose KV this node receives (prompt + tokens already sent)
        assert lease.reservation is not None, "a node attempt needs the node's reservation (reservations.lease_node)"
        self.reservation: Reservation = lease.reservation
        self.transfer_id = self.reservation.transfer_id
        self.token = self.reservation.token
        self.stage = "start"  # start -> prefilled -> decoding -> idle; "refused": prefill answered an error; "faulted"
        self.node_timings: dict[str, Any] | None = None  # the node's done line's `timings` (its phases, for the timeline)
        self.first_token: int | None = None
        self.first_logprob: TokenLogprob | None = None
        self.resp: UpstreamStream | None = None
        self.tripped: str | None = None  # why the watchdog ended the wait
        self.deadline_s = 0.0  # of the current wait
        self._opening: asyncio.Future[Any] | None = None
        self._lines_seen = False
        self._settled = False
        self.trace_headers: dict[str, str] = {}  # `traceparent` when tracing is on
        lease.node.transfer_id = self.transfer_id

    @property
    def node_name(self) -> str:
        return self.lease.node.name

    def marker(self) -> dict[str, Any]:
        """vLLM's `kv_transfer_params`: the connector's marker, and (tracing on) the request span for its hand-off spans."""
        ep = self.lease.node.endpoint
        params = TilepdMarker(host=ep.host, ctrl_port=ep.ctrl_port, transfer_id=self.transfer_id, token=self.token).as_params()
        fingerprint = (self.lease.node.capabilities or {}).get("fingerprint")
        if fingerprint:  # the connector refuses the claim when the node holds another checkpoint than the prefill serves
            params[NODE_FINGERPRINT_KEY] = fingerprint
        if "traceparent" in self.trace_headers:
            params["tilepd_traceparent"] = self.trace_headers["traceparent"]  # beside the marker: an older connector ignores it
        return params

    # -- the watchdog --------------------------------------------------------------------
    def step_s(self) -> float:
        return self.lease.node.step_s or DEFAULT_STEP_S

    def on_chunk(self, waited_s: float, chunk: bytes) -> None:
        tokens = chunk.count(b'{"token"')
        if tokens and self._lines_seen:
            self.lease.node.note_step(waited_s / tokens)  # the first wait includes the KV: not a step
        self._lines_seen = True
        self.deadline_s = STALL_STEPS * self.step_s() + DEADLINE_SLACK_S

    def _first_token_deadline(self) -> float:
        return KV_WAIT_S + FIRST_TOKEN_STEPS * self.step_s() + DEADLINE_SLACK_S

    async def watch(self) -> None:
        """Trip when the node is silent past the deadline, fails its liveness probes while silent, or leaves rotation."""
        left = self.lease.node.left_rotation
        misses, probed_wait = 0, None
        lag = self.state.loop_lag
        while self.tripped is None and self.stage not in ("idle", "faulted"):
            if self.reservation.lost is not None:
                return self._trip(f"{RESERVATION_LOST} ({self.reservation.lost})")
            since = self.waiting_since
            if since is not None:
                # time the router itself was held up is not the node's silence (loop_lag.py)
                waited = time.monotonic() - since - lag.stalled_s(since)
                if left.is_set() and waited >= OUT_OF_ROTATION_GRACE_S:
                    return self._trip("out_of_rotation")
                if waited >= self.deadline_s:
                    return self._trip(f"deadline {self.deadline_s:.1f}s")
                if waited >= LIVENESS_AFTER_S:
                    if probed_wait != since:
                        misses, probed_wait = 0, since
                    probed = time.monotonic()
                    alive = await node_alive(self.state.client, self.lease.node.base_url, LIVENESS_PROBE_TIMEOUT_S)
                    if alive:
                        misses = 0
                    elif lag.judges(probed, time.monotonic() - probed):  # else: the router was held up, no miss
                        misses += 1
                    if misses >= LIVENESS_MISSES and self.waiting_since == since:
                        return self._trip(f"unresponsive ({misses} health probes failed)")
            try:
                await asyncio.wait_for(left.wait(), timeout=LIVENESS_INTERVAL_S) if not left.is_set() else \
                    await asyncio.sleep(LIVENESS_INTERVAL_S)
            except TimeoutError:
                pass

    def _trip(self, why: str) -> None:
        """End the wait: cancel the pending open, or close the stream so the pending read fails."""
        self.tripped = why
        log.warning("req=%s event=node_silent node=%s transfer=%s why=%s waited_s=%.1f", self.request_id, self.node_name,
                    self.transfer_id, why, time.monotonic() - (self.waiting_since or time.monotonic()))
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        if self.resp is not None:
            self.state.spawn(self.resp.aclose())

    # -- the decode ----------------------------------------------------------------------
    async def open(self, body: dict[str, Any]) -> UpstreamStream:
        """Start the streamed decode; the first-token deadline starts now and runs until the first line."""
        self.deadline_s = self._first_token_deadline()
        self.waiting_since = time.monotonic()
        self._opening = asyncio.ensure_future(self._open_retrying_busy(body))
        try:
            self.resp = await self._opening
        except asyncio.CancelledError:
            if self.tripped is None:
                raise
            raise self.fault("silent", f"no answer within {self.deadline_s:.1f}s ({self.tripped})") from None
        except DecodeNodeError as exc:
            if exc.status in NODE_FREED_SLOT:
                self.stage = "idle"
            if exc.status == 0:
                raise NodeFault(exc, down=True) from None
            if exc.status in RETRY_ELSEWHERE:
                raise NodeFault(exc, down=False) from None
            raise
        finally:
            self._opening = None
        self.stage = "decoding"
        return self.resp

    def fault(self, code: str, message: str) -> NodeFault:
        """The node failed this request: down (out of rotation), unless the node only took its reservation back."""
        lost = (self.tripped or "").startswith(RESERVATION_LOST)
        return NodeFault(DecodeNodeError(self.node_name, 0, code, message), down=not lost)

    async def _open_retrying_busy(self, body: dict[str, Any]) -> UpstreamStream:
        node = self.lease.node
        deadline = time.monotonic() + BUSY_RETRY_S
        while True:
            try:
                return await open_decode(self.state.client, node.name, node.base_url, body, self.request_id,
                                         {**self.state.node_headers, **self.trace_headers})
            except DecodeNodeError as exc:
                if exc.status == 429 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                    continue
                raise

    # -- giving the node back ------------------------------------------------------------
    def settle_soon(self) -> None:
        """Return the lease once the node is idle; never awaits, so it is safe in any `finally`."""
        if self._settled:
            return
        self._settled = True
        if self.stage == "idle":
            self._close_resp_soon()
            end_renewal(self.lease)
            self.lease.release()
            return
        self.state.spawn(self._settle())

    def _close_resp_soon(self) -> None:
        if self.resp is not None and not self.resp.is_closed:
            self.state.spawn(self.resp.aclose())

    async def _settle(self) -> None:
        node = self.lease.node
        t0 = time.perf_counter()
        try:
            if self.stage == "refused":  # no KV will come: end the reservation on the node
                await cancel_decode(self.state.client, node.base_url, self.transfer_id, headers=self.state.node_headers,
                                    fence=self.reservation.fence)
                return
            if self.stage == "faulted":
                if self.resp is not None:
                    await self.resp.aclose()
                await cancel_decode(self.state.client, node.base_url, self.transfer_id, FAULT_CANCEL_TIMEOUT_S, headers=self.state.node_headers,
                                    fence=self.reservation.fence)
                return
            freed = False
            if self.stage == "prefilled":
                freed = await self._join_and_free(JOIN_KV_TIMEOUT_S)
            elif self.stage == "start":
                freed = await self._join_and_free(JOIN_INTERRUPTED_KV_TIMEOUT_S)
            if not freed:
                await cancel_decode(self.state.client, node.base_url, self.transfer_id, headers=self.state.node_headers,
                                    fence=self.reservation.fence)
                if self.resp is not None:
                    await self.resp.aclose()
                await self._wait_idle()
        except Exception as exc:  # noqa: BLE001 - never let a cleanup error keep the node leased
            log.warning("req=%s event=settle_error node=%s transfer=%s error=%r", self.request_id, node.name, self.transfer_id, exc)
        finally:
            end_renewal(self.lease)
            self.lease.release()
            log.info("req=%s event=lease_returned node=%s stage=%s settle_ms=%.1f", self.request_id, node.name, self.stage,
                     (time.perf_counter() - t0) * 1e3)

    async def _join_and_free(self, kv_timeout_s: float) -> bool:
        """Join this transfer with a one-step decode whose output is thrown away; True once the slot is ours no more."""
        node = self.lease.node
        body = DecodeBody(transfer_id=self.transfer_id, token=self.token, fence=self.reservation.fence, first_token=self.first_token or 0,
                          prompt_tokens=self.context_len, max_tokens=1, stream=False, kv_timeout_s=kv_timeout_s).as_json()
        status = await join_decode(self.state.client, node.base_url, body, self.request_id, kv_timeout_s + 5.0, self.state.node_headers)
        # 200 decoded, 504 the KV never came, 499 cancelled: in each case the node freed the slot
        return status in (200, 499, 504)

    async def _wait_idle(self) -> None:
        node = self.lease.node
        deadline = time.monotonic() + IDLE_WAIT_S
        while time.monotonic() < deadline:
            status = await node_status(self.state.client, node.base_url)
            if status is not None and (not status.get("busy") or status.get("transfer_id") not in (None, self.transfer_id)):
                return
            await asyncio.sleep(0.01)
        log.warning("req=%s event=node_not_idle node=%s transfer=%s waited_s=%.1f", self.request_id, node.name, self.transfer_id, IDLE_WAIT_S)


class LowLatencyRun:
    """One request on the low-latency pool: one node, or several when a node fails under it."""

    def __init__(self, state: RouterState, plan: EnginePlan, lease: Lease, request_id: str, timeline: Timeline | None = None) -> None:
        self.state = state
        self.plan = plan
        self.request_id = request_id
        self.timeline = timeline if timeline is not None else Timeline(request_id)
        self.attempt = self._attempt(lease, len(plan.prompt_ids))
        self.prompt_tokens = 0
        self.failovers = 0
        self.user: str | None = None  # the client's end-user id, for the log line
        self.tokens: list[int] = []  # every token the request produced (the first from the prefill), for the divergence watch

    def _attempt(self, lease: Lease, context_len: int) -> NodeAttempt:
        att = NodeAttempt(self.state, lease, self.request_id, context_len)
        att.trace_headers = self.timeline.trace_headers
        return att

    @property
    def transfers(self) -> list[str]:
        """Every transfer id this request used, in order (the keys of the connector's and the nodes' log lines)."""
        return [str(s.attrs["transfer"]) for s in self.timeline.spans if s.name == "prefill" and "transfer" in s.attrs]

    @property
    def lease(self) -> Lease:
        return self.attempt.lease

    @property
    def stage(self) -> str:
        return self.attempt.stage

    def _sampling(self) -> dict[str, Any]:
        p = self.plan
        out: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                               "stop_token_ids": p.stop_token_ids, "ignore_eos": p.ignore_eos}
        if p.seed is not None:
            out["seed"] = p.seed
        return out

    async def events(self) -> AsyncIterator[TextDelta | Finished]:
        """Prefill, then decode; the first event comes only after prefill succeeded."""
        t0 = time.perf_counter()
        t_prefill = t0
        tl = self.timeline
        text: _TextState | None = None
        try:
            while True:
                att = self.attempt
                context = self.plan.prompt_ids + (text.tokens if text is not None else [])
                try:
                    first, finish = await self._prefill(att, context, continuing=text is not None)
                finally:
                    tl.upto("prefill", node=att.node_name, transfer=att.transfer_id, tokens=len(context))
                if text is None:
                    t_prefill = time.perf_counter()
                    tl.mark("first_token", t_prefill)
                    text = _TextState(self.plan, self.state)
                    self.tokens = text.tokens
                out = text.consume(first, att.first_logprob)
                if text.finish_reason is None and finish == "stop":
                    text.finish_reason = "stop"  # vLLM knows a stop token the router's list missed
                if out or self.failovers == 0 or text.pending_logprobs:
                    yield TextDelta(out, text.take_logprobs(), text.take_tokens())
                if text.finish_reason is not None:
                    break
                stretch = tl.cursor
                try:
                    async for out in self._decode(att, text):
                        if out or text.pending_logprobs:
                            yield TextDelta(out, text.take_logprobs(), text.take_tokens())
                    tl.node_stretch(stretch, time.perf_counter(), att.node_timings, node=att.node_name)
                    break
                except NodeFault as fault:
                    tl.upto("failed_attempt", node=att.node_name, cause=fault.error.code, status=fault.error.status)
                    if self.plan.structured is not None:
                        self._give_up(att, fault)
                    if not await self._fail_over(att, fault, text.count):
                        tl.attrs["fallback"] = "native_continue"
                        if self.plan.logprobs is not None:  # the native continuation carries no logprobs: never drop them
                            raise DecodeNodeError(fault.error.node, 502, "node_faults", "the decode node failed and the native "
                                                  "continuation cannot return logprobs") from None
                        try:
                            async for out in self._continue_native(text):
                                if out:
                                    yield TextDelta(out, tokens=text.take_tokens())
                        finally:
                            tl.upto("native_continue")
                        break
                except BaseException:
                    if tl.cursor == stretch:  # a decode error, the client gone: the time on the node is still the decode's
                        tl.node_stretch(stretch, time.perf_counter(), att.node_timings, node=att.node_name)
                    raise
            timings = {"prefill_ms": (t_prefill - t0) * 1e3, "total_ms": (time.perf_counter() - t0) * 1e3}
            yield Finished(text.finish_reason or "length", text.stop_reason, self.prompt_tokens, text.count, timings, self.failovers)
        finally:
            self.settle_soon()

    async def _prefill(self, att: NodeAttempt, context: list[int], continuing: bool) -> tuple[int, str]:
        body = {"model": self.state.config.served_model_name, "prompt": context, "max_tokens": 1,
                "stream": False, "logprobs": max(1, self.plan.logprobs or 0), "kv_transfer_params": att.marker(),
                "skip_special_tokens": self.plan.skip_special_tokens, **self._sampling()}
        if self.plan.structured is not None:
            body.update(self.plan.structured.prefill)
        try:
            prefill = await prefill_first_token(self.state.client, self.state.next_prefill_url(), body, self.request_id,
                                                self.timeline.trace_headers)
        except PassThroughError as exc:
            att.stage = "refused"
            if not continuing and exc.status == 400 and self.plan.structured is not None:
                detail = exc.body[:500].decode("utf-8", "replace")
                try:
                    detail = str(json.loads(exc.body)["error"]["message"])[:500]
                except (ValueError, KeyError, TypeError):
                    pass
                raise invalid(self.plan.structured.field, f"the constraint was refused by the prefill: {detail}") from None
            if not continuing:
                raise
            detail = exc.body[:300].decode("utf-8", "replace")
            raise RouterError(502, f"prefill refused the continuation on another node: {exc.status} {detail}",
                              type="prefill_error", code="continuation_failed") from None
        except RouterError:
            att.stage = "refused"
            raise
        handoff = prefill.handoff or {}
        if handoff.get("state") == "refused":  # nothing reached the node: the lease goes back now
            att.stage = "refused"
            log.warning("req=%s event=handoff_refused node=%s transfer=%s reason=%r", self.request_id, att.node_name,
                        att.transfer_id, str(handoff.get("reason", "?"))[:300])
            raise HandoffRefused(att.node_name, str(handoff.get("reason", "no reason given")))
        att.stage = "prefilled"
        att.first_token = prefill.first_token
        if self.plan.logprobs is not None:
            try:
                att.first_logprob = from_prefill(prefill.choice or {}, self.plan.logprobs)
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise RouterError(502, f"prefill answered without the first token's logprobs: {exc}", type="prefill_error",
                                  code="prefill_bad_response") from None
        if not continuing:
            self.prompt_tokens = prefill.prompt_tokens
        return prefill.first_token, prefill.finish_reason

    async def _decode(self, att: NodeAttempt, text: _TextState) -> AsyncIterator[str]:
        node = att.lease.node
        fields: dict[str, Any] = {**self._sampling(), "seed": self.plan.seed}
        if self.plan.logprobs is not None:
            fields["top_logprobs"] = self.plan.logprobs
        if self.plan.structured is not None:
            fields["structured_output"] = self.plan.structured.node
        body = DecodeBody(transfer_id=att.transfer_id, token=att.token, fence=att.reservation.fence, first_token=att.first_token,
                          prompt_tokens=att.context_len, max_tokens=self.plan.max_tokens - text.count, stream=True,
                          kv_timeout_s=KV_WAIT_S, **fields).as_json()
        watchdog = asyncio.ensure_future(att.watch())
        try:
            resp = await att.open(body)
            async for msg in decode_lines(node.name, resp, att):
                token = msg.get("token")
                if token is not None:
                    if text.finish_reason is not None:
                        return  # the router saw the end first (its EOS list): settle_soon cancels the rest
                    out = text.consume(token, from_node(msg) if self.plan.logprobs is not None else None)
                    yield out
                    if isinstance(text.stop_reason, str):
                        return  # a stop string: the node would go on, settle_soon cancels it
                    # length, EOS and stop token ids end on the node too: its done line follows
                elif msg.get("error") or msg.get("finish_reason") == "error":
                    att.stage = "idle"  # the node ended the decode and freed the slot
                    err = msg.get("error") or {}
                    raise NodeFault(DecodeNodeError(node.name, 502, str(err.get("code", "engine_error")), str(err.get("message", ""))),
                                    down=False)
                elif msg.get("done"):
                    att.stage = "idle"
                    if isinstance(msg.get("timings"), dict):
                        att.node_timings = msg["timings"]
                    reason = msg.get("finish_reason")
                    if reason == "cancelled":
                        raise DecodeNodeError(node.name, 499, "cancelled", "the decode was cancelled on the node")
                    if text.finish_reason is None:  # the node knows a stop the router did not
                        text.finish_reason = "stop" if reason == "stop" else "length"
                    yield text.stops.sendable(True)
                    return
            raise att.fault(f"silent:{att.tripped}" if att.tripped else "stream_truncated", "the decode stream ended without a done line")
        except DecodeNodeError as exc:
            if exc.status == 0 or att.tripped is not None:
                code = f"silent:{att.tripped}" if att.tripped else exc.code
                raise att.fault(code, exc.message) from None
            raise
        finally:
            watchdog.cancel()

    def _give_up(self, att: NodeAttempt, fault: NodeFault) -> None:
        """A constrained request cannot continue elsewhere (a continuation prefill would restart the grammar):
        leave the node as _fail_over does, then raise a typed error."""
        err = fault.error
        log.warning("req=%s event=node_fault node=%s transfer=%s status=%d code=%s down=%s constrained=1", self.request_id,
                    err.node, att.transfer_id, err.status, err.code, fault.down)
        if fault.down:
            self.state.metrics.node_down(self.state.pool, att.lease.node, f"{err.code}: {err.message}")
            if att.stage != "idle":
                att.stage = "faulted"
        att.settle_soon()
        raise DecodeNodeError(err.node, 502, "node_faults", f"decode node {err.node} failed ({err.code}: {err.message}); a "
                              "structured-output request cannot continue on another node")

    async def _fail_over(self, att: NodeAttempt, fault: NodeFault, tokens_sent: int) -> bool:
        """Leave the failed node (out of rotation if it is down) and lease another: True. False: go on in the native pool.
        Raise a typed error when nothing can take the request."""
        err = fault.error
        cause = err.code.split(":")[0] if err.code else "error"
        log.warning("req=%s event=node_fault node=%s transfer=%s status=%d code=%s down=%s tokens_sent=%d message=%s",
                    self.request_id, err.node, att.transfer_id, err.status, err.code, fault.down, tokens_sent, err.message)
        if fault.down:
            self.state.metrics.node_down(self.state.pool, att.lease.node, f"{err.code}: {err.message}")
            if att.stage != "idle":
                att.stage = "faulted"
        elif err.code == "draining":  # leased before the health check saw the drain: lease it no more (health.py undoes it)
            self.state.pool.set_draining(att.lease.node, True)
        att.settle_soon()
        limit = len(self.state.pool.nodes)
        if self.failovers >= limit:
            raise DecodeNodeError(err.node, 502, "node_faults", f"{self.failovers + 1} decode nodes failed this request; "
                                  f"last: {err.code}: {err.message}")
        cfg = self.state.config
        native = cfg.native_pool is not None and cfg.routing.fallback_to_native
        try:
            try:
                lease = await lease_node(self.state, cfg.queue_timeout_s)
            except NoNodeInRotation:
                if native:
                    raise
                log.warning("req=%s event=failover_waits from=%s cause=%s why='no node in rotation and no native pool' "
                            "wait_s=%g", self.request_id, err.node, cause, REJOIN_WAIT_S)
                lease = await lease_node(self.state, REJOIN_WAIT_S, when_back=True)
        except (LeaseTimeout, NoNodeInRotation) as exc:
            self.timeline.upto("queue_wait", retry=True)
            if native:
                self.failovers += 1
                self.state.metrics.failovers.labels(cause).inc()
                log.info("req=%s event=failover from=%s to=native cause=%s why=%r", self.request_id, err.node, cause, str(exc))
                return False
            raise DecodeNodeError(err.node, 502, "no_node_to_continue", f"decode node {err.node} failed ({err.code}: {err.message}) "
                                  f"and no other node could take the request: {exc}") from None
        self.timeline.upto("queue_wait", node=lease.node.name, retry=True)
        self.failovers += 1
        self.state.metrics.failovers.labels(cause).inc()
        self.attempt = self._attempt(lease, len(self.plan.prompt_ids) + tokens_sent)
        log.info("req=%s event=failover from=%s to=%s cause=%s", self.request_id, err.node, lease.node.name, cause)
        return True

    async def _continue_native(self, text: _TextState) -> AsyncIterator[str]:
        """The rest of the request from the native pool, through the request's own detokenizer and stop matcher."""
        context = self.plan.prompt_ids + text.tokens
        async for token in native_tokens(self.state, context, self.plan.max_tokens - text.count, self._sampling(), self.request_id):
            yield text.consume(token)
            if text.finish_reason is not None:
                break  # settles on the native side: the stream is closed
        if text.finish_reason is None:  # vLLM ended on a stop the router's lists missed
            text.finish_reason = "length" if text.count >= self.plan.max_tokens else "stop"
        yield text.stops.sendable(True)

    def settle_soon(self) -> None:
        self.attempt.settle_soon()
