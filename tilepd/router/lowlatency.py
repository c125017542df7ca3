"""The low-latency flow: prefill on vLLM with the router's marker, then stream from a leased decode node.

One `LowLatencyRun` per request. Its `events()` yields text deltas and one `Finished`;
whatever way the request ends (finished, stop string, error, client gone, shutdown),
`settle_soon()` returns the node to the pool only once the node is idle again, in a
background task so that a cancelled request cannot skip it.

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
- prefill refused by vLLM (an error response): nothing reached the connector; release.
- decoding: `/v1/cancel`, close the stream, wait until `/status` shows the node idle.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tilepd.auth import transfer_token
from tilepd.router.backends import DecodeNodeError, cancel_decode, decode_lines, node_status, open_decode, prefill_first_token
from tilepd.router.detok import make_detokenizer
from tilepd.router.errors import PassThroughError, RouterError
from tilepd.router.leases import Lease
from tilepd.router.state import RouterState
from tilepd.router.stops import StopStringMatcher
from tilepd.router.upstream import UpstreamError, UpstreamStream

log = logging.getLogger("tilepd.router")

BUSY_RETRY_S = 1.0  # a node that still finishes its last request answers busy for a moment
IDLE_WAIT_S = 5.0  # how long a cancelled node may take to report idle before the lease is returned anyway
# decode-node answers after which the node has freed the slot itself (504 KV timeout, 499 cancelled, 502 transfer failed)
NODE_FREED_SLOT = frozenset({499, 502, 504})
JOIN_KV_TIMEOUT_S = 10.0  # a join after a finished prefill: the KV is on its way
JOIN_INTERRUPTED_KV_TIMEOUT_S = 3.0  # a join after an interrupted prefill: the KV may never come


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


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    stop_reason: str | int | None
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float] = field(default_factory=dict)


class _TextState:
    """Token ids in, safe-to-send text out; decides when the request is finished."""

    def __init__(self, plan: EnginePlan, state: RouterState) -> None:
        self.plan = plan
        self.detok = make_detokenizer(state.renderer.tokenizer, plan.prompt_ids, plan.skip_special_tokens)
        self.stops = StopStringMatcher(plan.stop, plan.include_stop_str_in_output)
        self.stop_ids = frozenset(plan.stop_token_ids)
        self.terminators = self.stop_ids if plan.ignore_eos else self.stop_ids | state.renderer.eos_token_ids
        self.count = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def consume(self, token: int) -> str:
        """Account one generated token; return the text now safe to send."""
        self.count += 1
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


class LowLatencyRun:
    """One request on one leased decode node."""

    def __init__(self, state: RouterState, plan: EnginePlan, lease: Lease, request_id: str) -> None:
        self.state = state
        self.plan = plan
        self.lease = lease
        self.request_id = request_id
        self.transfer_id = f"tx-{uuid.uuid4().hex}"
        # with a deployment secret the token is HMAC(secret, transfer id): the node checks it without state
        self.token = transfer_token(state.node_secret, self.transfer_id) if state.node_secret else secrets.token_hex(16)
        self.stage = "start"  # start -> prefilled -> decoding -> idle; "refused": prefill answered an error
        self.first_token: int | None = None
        self.prompt_tokens = 0
        self._resp: UpstreamStream | None = None
        self._settled = False
        self.user: str | None = None  # the client's end-user id, for the log line
        lease.node.transfer_id = self.transfer_id

    def marker(self) -> dict[str, Any]:
        ep = self.lease.node.endpoint
        return {"tilepd": {"host": ep.host, "ctrl_port": ep.ctrl_port, "transfer_id": self.transfer_id, "token": self.token}}

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
        try:
            body = {"model": self.state.config.served_model_name, "prompt": self.plan.prompt_ids, "max_tokens": 1,
                    "stream": False, "logprobs": 1, "kv_transfer_params": self.marker(),
                    "skip_special_tokens": self.plan.skip_special_tokens, **self._sampling()}
            try:
                prefill = await prefill_first_token(self.state.client, self.state.next_prefill_url(), body, self.request_id)
            except (RouterError, PassThroughError):
                self.stage = "refused"
                raise
            self.stage = "prefilled"
            self.first_token, self.prompt_tokens = prefill.first_token, prefill.prompt_tokens
            t_prefill = time.perf_counter()
            text = _TextState(self.plan, self.state)
            out = text.consume(prefill.first_token)
            if text.finish_reason is None and prefill.finish_reason == "stop":
                text.finish_reason = "stop"  # vLLM knows a stop token the router's list missed
            yield TextDelta(out)
            if text.finish_reason is None:
                async for out in self._decode(text):
                    if out:
                        yield TextDelta(out)
            timings = {"prefill_ms": (t_prefill - t0) * 1e3, "total_ms": (time.perf_counter() - t0) * 1e3}
            yield Finished(text.finish_reason or "length", text.stop_reason, self.prompt_tokens, text.count, timings)
        finally:
            self.settle_soon()

    async def _decode(self, text: _TextState) -> AsyncIterator[str]:
        node = self.lease.node
        body = {"transfer_id": self.transfer_id, "token": self.token, "first_token": self.first_token,
                "prompt_tokens": self.prompt_tokens, "max_tokens": self.plan.max_tokens - 1, "stream": True,
                **self._sampling(), "seed": self.plan.seed}
        try:
            self._resp = await self._open_decode(body)
        except DecodeNodeError as exc:
            if exc.status in NODE_FREED_SLOT:
                self.stage = "idle"
            raise
        self.stage = "decoding"
        async for msg in decode_lines(node.name, self._resp):
            token = msg.get("token")
            if token is not None:
                if text.finish_reason is not None:
                    return  # the router saw the end first (its EOS list): settle_soon cancels the rest
                out = text.consume(token)
                yield out
                if isinstance(text.stop_reason, str):
                    return  # a stop string: the node would go on, settle_soon cancels it
                # length, EOS and stop token ids end on the node too: its done line follows
            elif msg.get("error") or msg.get("finish_reason") == "error":
                self.stage = "idle"  # the node ended the decode and freed the slot
                err = msg.get("error") or {}
                raise DecodeNodeError(node.name, 502, str(err.get("code", "engine_error")), str(err.get("message", "")))
            elif msg.get("done"):
                self.stage = "idle"
                reason = msg.get("finish_reason")
                if reason == "cancelled":
                    raise DecodeNodeError(node.name, 499, "cancelled", "the decode was cancelled on the node")
                if text.finish_reason is None:  # the node knows a stop the router did not
                    text.finish_reason = "stop" if reason == "stop" else "length"
                yield text.stops.sendable(True)
                return
        raise DecodeNodeError(node.name, 502, "stream_truncated", "the decode stream ended without a done line")

    async def _open_decode(self, body: dict[str, Any]) -> UpstreamStream:
        node = self.lease.node
        deadline = time.monotonic() + BUSY_RETRY_S
        while True:
            try:
                return await open_decode(self.state.client, node.name, node.base_url, body, self.request_id, self.state.node_headers)
            except DecodeNodeError as exc:
                if exc.status == 429 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                    continue
                if exc.status == 0:
                    self.state.metrics.node_failure(self.state.pool, node, exc.code)
                raise

    def settle_soon(self) -> None:
        """Return the lease once the node is idle; never awaits, so it is safe in any `finally`."""
        if self._settled:
            return
        self._settled = True
        if self.stage in ("idle", "refused"):
            self._close_resp_soon()
            self.lease.release()
            return
        self.state.spawn(self._settle())

    def _close_resp_soon(self) -> None:
        if self._resp is not None and not self._resp.is_closed:
            self.state.spawn(self._resp.aclose())

    async def _settle(self) -> None:
        node = self.lease.node
        t0 = time.perf_counter()
        try:
            freed = False
            if self.stage == "prefilled":
                freed = await self._join_and_free(JOIN_KV_TIMEOUT_S)
            elif self.stage == "start":
                freed = await self._join_and_free(JOIN_INTERRUPTED_KV_TIMEOUT_S)
            if not freed:
                await cancel_decode(self.state.client, node.base_url, self.transfer_id, headers=self.state.node_headers)
                if self._resp is not None:
                    await self._resp.aclose()
                await self._wait_idle()
        except Exception as exc:  # never let a cleanup error keep the node leased
            log.warning("req=%s event=settle_error node=%s transfer=%s error=%r", self.request_id, node.name, self.transfer_id, exc)
        finally:
            self.lease.release()
            log.info("req=%s event=lease_returned node=%s stage=%s settle_ms=%.1f", self.request_id, node.name, self.stage,
                     (time.perf_counter() - t0) * 1e3)

    async def _join_and_free(self, kv_timeout_s: float) -> bool:
        """Join this transfer with a one-step decode whose output is thrown away; True once the slot is ours no more."""
        node = self.lease.node
        body = {"transfer_id": self.transfer_id, "token": self.token, "first_token": self.first_token or 0,
                "prompt_tokens": len(self.plan.prompt_ids), "max_tokens": 1, "stream": False, "kv_timeout_s": kv_timeout_s}
        try:
            resp = await self.state.client.request("POST", f"{node.base_url}/v1/decode", body=body,
                                                    headers={"x-request-id": self.request_id, **self.state.node_headers},
                                                    timeout_s=kv_timeout_s + 5.0)
        except UpstreamError:
            return False
        # 200 decoded, 504 the KV never came, 499 cancelled: in each case the node freed the slot
        return resp.status in (200, 499, 504)

    async def _wait_idle(self) -> None:
        node = self.lease.node
        deadline = time.monotonic() + IDLE_WAIT_S
        while time.monotonic() < deadline:
            status = await node_status(self.state.client, node.base_url)
            if status is not None and (not status.get("busy") or status.get("transfer_id") not in (None, self.transfer_id)):
                return
            await asyncio.sleep(0.01)
        log.warning("req=%s event=node_not_idle node=%s transfer=%s waited_s=%.1f", self.request_id, node.name, self.transfer_id, IDLE_WAIT_S)
