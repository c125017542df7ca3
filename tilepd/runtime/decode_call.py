"""One `POST /v1/decode` on the node, as named steps (INTERFACES §4).

`serve_decode` runs them in order: `refusal` (what the node will not take, before the slot is touched),
`await_kv` (take the slot, wait until the transfer's KV landed), `submit` (the engine job, queued on the engine
thread), then `ndjson` (a stream: tokens as they come, one done line) or `collect` (one JSON body), each ending
with `final_timings` (the node's phases for the router's timeline, the trace, the done log line). A `DecodeCall`
carries what one step learnt to the next, as nano-vllm's `Sequence` does for its `step`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tilepd.auth import transfer_token_ok
from tilepd import __version__
from tilepd.contracts.decode_http import NODE_API_VERSION, DecodeBody, StructuredOutputBody
from tilepd.runtime.http_errors import error_response, unauthorized
from tilepd.runtime.service import DecodeJob, DecodeOutcome, DecodeService
from tilepd.runtime.slot import SlotError, Transfer
from tilepd.runtime.token_stream import TokenStream

log = logging.getLogger("tilepd.runtime.http")

# Parameters a client may send that some engines cannot honour: (field, value that means "off").
OPTIONAL_FEATURES: dict[str, Any] = {
    "logprobs": None, "top_logprobs": None, "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "min_p": 0.0,
}
# Sampling parameters the engine must declare (capabilities) when set to a non-default value.
SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop_token_ids": [], "ignore_eos": False}

SLOT_STATUS = {"busy": 429, "bad_token": 409, "duplicate": 409, "kv_timeout": 504, "cancelled": 499, "transfer_failed": 502,
               "kv_checksum_mismatch": 502,  # the KV that landed is not what the prefill staged: never decoded
               "draining": 503,  # retryable: the router goes to another node
               "reservation_lost": 410,  # the router's lease ran out (or its fence is stale): the slot is another's
               "not_reserved": 409}  # no reservation for this transfer: the router skipped /v1/reserve


def older_router(what: str) -> JSONResponse:
    """The answer to a caller of node API 1 (no reservation, no fence): what to upgrade."""
    return error_response(426, "node_api_mismatch", f"this decode node speaks node API {NODE_API_VERSION} (tilepd {__version__}): "
                          f"{what}; upgrade the router (and the hosts running `tilepd up`) to tilepd >= {__version__}")


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


async def serve_decode(svc: DecodeService, body: DecodeBody, request: Request,
                       secret: bytes | None) -> JSONResponse | StreamingResponse | dict[str, Any]:
    """The steps of one decode; an answer before the first token is a typed HTTP error (http_api's docstring)."""
    call = DecodeCall(svc, body, request)
    refused = await call.refusal(secret)
    if refused is None:
        refused = await call.await_kv()
    if refused is not None:
        return refused
    call.submit()
    if body.stream:
        return StreamingResponse(call.ndjson(), media_type="application/x-ndjson")
    return await call.collect()


class DecodeCall:
    """One decode request's state on the node: each step reads what the steps before it left here."""

    transfer: Transfer  # the slot's transfer, once await_kv reserved it
    tokens: TokenStream  # engine thread -> NDJSON chunks, once submitted
    job: DecodeJob
    future: asyncio.Future[DecodeOutcome]  # the engine's run of the job

    def __init__(self, svc: DecodeService, body: DecodeBody, request: Request) -> None:
        self.svc = svc
        self.body = body
        self.request = request
        self.tid = body.transfer_id
        self.rid = request.headers.get("x-request-id", "-")
        self.want_logprobs: int | None = None  # top-n logprobs per token (0: the sampled token's only); None: none
        self.grammar: Any = None  # the structured_output constraint's matcher, advanced by first_token
        self.t_arrive = 0.0  # perf_counter when the slot was asked for
        self.arrived_ns = 0  # the same, as wall-clock ns (the trace's start)
        self.wait_s = 0.0  # until the KV had landed and the slot was ours
        self.transfer_ms: float | None = None  # the wire time as this node saw it (admit -> every rank done)
        self.token_logprobs: list[dict[str, Any]] = []  # non-streamed: every token's, in order
        self.t_submit = 0.0
        self.started: list[float] = []  # when the engine thread took the job

    # -- step 1: what the node will not take --------------------------------------------
    async def refusal(self, secret: bytes | None) -> JSONResponse | None:
        """The answer refusing this request before the slot is touched, or None: the node takes it."""
        svc, body, tid = self.svc, self.body, self.tid
        if secret is not None and not transfer_token_ok(secret, tid, body.token):
            svc.metrics.requests.labels("unauthorized").inc()
            log.warning("event=decode_refused transfer_id=%s code=invalid_transfer_token", tid)
            return unauthorized(f"token of transfer {tid} was not minted with this deployment's secret", "invalid_transfer_token")
        if body.fence is None:
            log.warning("event=decode_refused transfer_id=%s code=node_api_mismatch reason=no fence", tid)
            return older_router("a router reserves the slot (POST /v1/reserve) and names the reservation's fence in /v1/decode; "
                                "this request names none")
        if not svc.ready:
            return error_response(503, "not_ready", "decode node is starting")
        caps = svc.capabilities()["sampling"]
        refused = self._unfit(caps)
        if refused is None and body.structured_output is not None:
            refused = await self._constrain(body.structured_output, caps)
        return refused

    def _unfit(self, caps: dict[str, Any]) -> JSONResponse | None:
        """A parameter this engine cannot honour, or a request that cannot fit its sequence or vocabulary."""
        svc, body = self.svc, self.body
        bad = _unhonoured(body, caps)
        if bad is not None:
            svc.metrics.requests.labels("unsupported").inc()
            return error_response(501, "unsupported_parameter", f"this decode engine cannot honour {bad!r}", bad)
        want_logprobs = self.want_logprobs = _logprobs_wanted(body)
        if want_logprobs is not None and want_logprobs > int(caps.get("top_logprobs_max", 0)):
            field = "top_logprobs" if body.top_logprobs is not None else "logprobs"
            return error_response(400, "bad_parameter", f"{field} {want_logprobs} exceeds this engine's top_logprobs_max "
                                  f"{caps.get('top_logprobs_max', 0)}", field)
        if body.prompt_tokens + body.max_tokens > svc.config.max_seq_len:
            return error_response(400, "too_long", f"prompt_tokens {body.prompt_tokens} + max_tokens {body.max_tokens} exceeds "
                                  f"max_seq_len {svc.config.max_seq_len}", "max_tokens")
        vocab = svc.engine.config.vocab_size
        if body.first_token >= int(vocab):
            return error_response(400, "bad_parameter", f"first_token {body.first_token} outside the vocabulary ({vocab})", "first_token")
        return None

    async def _constrain(self, so: StructuredOutputBody, caps: dict[str, Any]) -> JSONResponse | None:
        """Compile the structured_output constraint (off the event loop); refuse a kind the engine lacks, a bad spec, or
        a first token the constraint does not allow."""
        svc, body = self.svc, self.body
        if so.type not in (caps.get("structured_output") or ()):
            svc.metrics.requests.labels("unsupported").inc()
            return error_response(501, "unsupported_parameter", f"this decode engine cannot honour structured_output {so.type!r}",
                                  "structured_output.type")
        try:
            self.grammar = await run_in_threadpool(svc.grammar_for, so.type, so.spec, body.stop_token_ids)
        except ValueError as exc:  # grammar.GrammarError: names the field
            return error_response(400, "bad_parameter", str(exc), getattr(exc, "field", "structured_output"))
        if not self.grammar.accept(body.first_token):
            return error_response(400, "bad_parameter", f"first_token {body.first_token} is not allowed by the structured_output "
                                  "constraint (the prefill must sample it under the same constraint)", "first_token")
        return None

    # -- step 2: the KV -----------------------------------------------------------------
    async def await_kv(self) -> JSONResponse | None:
        """Take the slot for this transfer and wait until its KV landed: None, the slot is decoding it; else the answer."""
        svc, body, tid = self.svc, self.body, self.tid
        self.t_arrive = time.perf_counter()
        self.arrived_ns = time.time_ns()
        try:
            transfer = self.transfer = svc.slot.attach_decode(tid, body.token, int(body.fence or 0))
        except SlotError as exc:
            svc.metrics.requests.labels(exc.code).inc()
            log.info("event=decode_refused transfer_id=%s code=%s", tid, exc.code)
            return error_response(SLOT_STATUS.get(exc.code, 409), exc.code, exc.message,
                                  headers={"Retry-After": "1"} if exc.code == "busy" else None,
                                  extra={"holder": exc.holder} if exc.holder else None)
        timeout = body.kv_timeout_s or svc.config.kv_timeout_s
        try:
            await run_in_threadpool(svc.slot.wait_complete, transfer, timeout)
            if transfer.seq_len != body.prompt_tokens:
                svc.slot.release(transfer, "prompt_tokens mismatch")
                return error_response(400, "bad_parameter", f"prompt_tokens {body.prompt_tokens} but the KV received covers "
                                      f"{transfer.seq_len} tokens", "prompt_tokens")
            svc.slot.start_decoding(transfer)
        except SlotError as exc:
            svc.metrics.requests.labels(exc.code).inc()
            log.warning("event=decode_failed transfer_id=%s code=%s message=%s", tid, exc.code, exc.message)
            return error_response(SLOT_STATUS.get(exc.code, 500), exc.code, exc.message)
        self.wait_s = time.perf_counter() - self.t_arrive
        svc.metrics.wait.observe(self.wait_s)
        # the wire time as this node saw it (admit -> every rank done); it overlaps the router's prefill call
        self.transfer_ms = ((transfer.completed_at - transfer.admitted_at) * 1e3
                            if transfer.completed_at is not None and transfer.admitted_at is not None else None)
        return None

    # -- step 3: the engine's job -------------------------------------------------------
    def submit(self) -> None:
        """Build the engine's job and queue it on the engine thread; the slot is released when it ends."""
        body = self.body
        self.tokens = TokenStream(asyncio.get_running_loop())  # token_stream.py: one wake-up per read, not per token
        sampling = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "seed", "ignore_eos")}
        sampling["stop_token_ids"] = tuple(body.stop_token_ids)
        if self.want_logprobs is None:
            self.job = DecodeJob(body.first_token, body.max_tokens, sampling, self.tokens.push, grammar=self.grammar)
        else:
            self.job = DecodeJob(body.first_token, body.max_tokens, sampling, lambda t: None, logprobs=self.want_logprobs,
                                 on_logprobs=self._on_logprobs, grammar=self.grammar)
        self.t_submit = time.perf_counter()
        self.future = asyncio.wrap_future(self.svc.worker.submit(self._work))
        self.future.add_done_callback(lambda f: self.tokens.close())
        log.info("event=decode_start transfer_id=%s req=%s seq_len=%d max_tokens=%d wait_ms=%.2f", self.tid, self.rid,
                 self.transfer.seq_len, body.max_tokens, self.wait_s * 1e3)

    def _on_logprobs(self, lp: Any) -> None:  # called right before on_token, with the same token
        entry = {"token": lp.token, **lp.to_json()}
        self.token_logprobs.append(entry)
        self.tokens.push(entry)

    def _work(self) -> DecodeOutcome:  # on the engine thread
        self.started.append(time.perf_counter())
        try:
            return self.svc.run_decode(self.transfer, self.job)
        finally:
            self.svc.slot.release(self.transfer, "cancelled" if self.transfer.cancel.is_set() else "finished")

    # -- step 4: the answer -------------------------------------------------------------
    async def ndjson(self) -> AsyncIterator[bytes]:
        """`stream: true`: NDJSON lines, {"token"} or {"token", "logprob", "top_logprobs"} each, then one done line; a
        client that goes away stops the engine at its next step."""
        finished = False
        try:
            while True:
                kind, val = await self.tokens.get()
                if kind == "token":  # val: one or more lines
                    yield val
                    continue
                try:
                    outcome = self.future.result()
                except Exception as exc:  # noqa: BLE001
                    log.exception("event=decode_error transfer_id=%s", self.tid)
                    finished = True  # the engine is done: a client leaving at the last line changes nothing
                    yield (json.dumps({"done": True, "finish_reason": "error", "error": {"code": "engine_error", "message": str(exc)}}) + "\n").encode()
                    return
                timings = self.final_timings(outcome)
                finished = True  # logged and counted once, whether or not the client reads the last line
                yield (json.dumps({"done": True, "finish_reason": outcome.finish_reason,
                                   "completion_tokens": len(outcome.tokens), "timings": timings}) + "\n").encode()
                return
        finally:
            if not finished:  # the client went away: stop the engine at its next step
                log.info("event=client_gone transfer_id=%s req=%s", self.tid, self.rid)
                self.transfer.cancel.set()
                self.future.add_done_callback(self._abandoned_done)

    def _abandoned_done(self, fut: asyncio.Future[DecodeOutcome]) -> None:
        """A stream whose client went away still ends with its `decode_done` line and count, once the engine stops."""
        if fut.cancelled():
            return
        if fut.exception() is not None:
            log.warning("event=decode_error transfer_id=%s req=%s error=%r", self.tid, self.rid, fut.exception())
            return
        self.final_timings(fut.result())

    async def collect(self) -> JSONResponse | dict[str, Any]:
        """`stream: false`: the whole decode as one JSON body."""
        try:
            outcome = await self.future
        except Exception as exc:  # noqa: BLE001 - engine failure becomes a typed 500
            log.exception("event=decode_error transfer_id=%s", self.tid)
            return error_response(500, "engine_error", f"{type(exc).__name__}: {exc}")
        timings = self.final_timings(outcome)
        if outcome.finish_reason == "cancelled" and not outcome.tokens:
            return error_response(499, "cancelled", f"transfer {self.tid} was cancelled")
        out = {"tokens": outcome.tokens, "finish_reason": outcome.finish_reason,
               "completion_tokens": len(outcome.tokens), "timings": timings}
        if self.want_logprobs is not None:
            out["logprobs"] = [{k: v for k, v in e.items() if k != "token"} for e in self.token_logprobs]
        return out

    def final_timings(self, outcome: DecodeOutcome) -> dict[str, Any]:
        """The node's phases, in order (the router's timeline places them in its decode stretch; INTERFACES §4); exported
        as a trace when the node has a collector, counted, and logged as `event=decode_done`."""
        svc, tid = self.svc, self.tid
        started = self.started
        timings = {"wait_ms": self.wait_s * 1e3, "queue_ms": ((started[0] if started else self.t_submit) - self.t_submit) * 1e3,
                   **outcome.timings}
        if self.transfer_ms is not None:
            timings["transfer_ms"] = self.transfer_ms
        timings["node_ms"] = (time.perf_counter() - self.t_arrive) * 1e3
        traceparent = self.request.headers.get("traceparent")
        if svc.tracing is not None and traceparent:
            try:
                if svc.tracing.export(traceparent, self.arrived_ns, timings, tid, outcome.finish_reason):
                    timings["traced"] = 1  # the router then leaves these phases out of its own export
            except Exception as exc:  # noqa: BLE001 - tracing never fails a decode
                log.warning("event=tracing_error transfer_id=%s error=%r", tid, exc)
        svc.last = timings
        svc.metrics.requests.labels(outcome.finish_reason).inc()
        log.info("event=decode_done transfer_id=%s req=%s finish=%s %s", tid, self.rid, outcome.finish_reason,
                 " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in timings.items()))
        return timings
