"""The native pool: stock vLLM P/D with NixlConnector, relayed as-is.

Prefill runs the client's request with `max_tokens=1` and `do_remote_decode`; vLLM
answers with `kv_transfer_params` naming its KV blocks, which the native decode
instance pulls over NIXL when it gets the original request with those params. The
router only rewrites what it must (model name, the prefill's token limit, the params)
and streams the decode instance's bytes back untouched.
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse

from tilepd.router.errors import PassThroughError, RouterError
from tilepd.router.state import RouterState
from tilepd.router.timeline import Timeline
from tilepd.router.upstream import UpstreamError, UpstreamStream

# what stock vLLM's NixlConnector producer expects on a prefill that a remote decode continues
DO_REMOTE_DECODE: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                    "remote_block_ids": None, "remote_host": None, "remote_port": None}
# The native pool is the fallback: a request sent there has nowhere else to go, so connect timeouts to its instances
# (an overloaded vLLM: a CPU native decode stopped taking connections for ~100 s under 19 concurrent fallbacks on the
# 2-core box while its NIXL reads stalled, then served them all) are retried this long before the request fails
NATIVE_CONNECT_PATIENCE_S = 60.0
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "server", "date"})


async def native_stream(state: RouterState, path: str, body: dict[str, Any], request_id: str,
                        timeline: Timeline | None = None) -> UpstreamStream:
    """Prefill on a native prefill instance, then open the request on a native decode instance; its response, unread.
    With `timeline`, the prefill call is its `native_prefill` phase (the decode's is the caller's to close)."""
    prefill_url, decode_url = state.next_native_urls()
    body = dict(body)
    body["model"] = state.config.served_model_name
    prefill_body = copy.deepcopy(body)
    prefill_body.update({"max_tokens": 1, "stream": False, "kv_transfer_params": DO_REMOTE_DECODE})
    prefill_body.pop("stream_options", None)
    if "max_completion_tokens" in prefill_body:
        prefill_body["max_completion_tokens"] = 1
    up_headers = {"x-request-id": request_id, **(timeline.trace_headers if timeline is not None else {})}
    try:
        resp = await state.client.request("POST", f"{prefill_url}{path}", body=prefill_body, headers=up_headers,
                                          connect_patience_s=NATIVE_CONNECT_PATIENCE_S)
    except UpstreamError as exc:
        if timeline is not None:
            timeline.upto("native_prefill")
        raise RouterError(502, f"native prefill {prefill_url} unreachable: {exc}", type="prefill_error",
                          code="prefill_unreachable") from exc
    if timeline is not None:
        timeline.upto("native_prefill", url=prefill_url)
    if resp.status != 200:
        raise PassThroughError(resp.status, resp.content, resp.headers.get("content-type", "application/json"))
    try:
        kv_params = resp.json().get("kv_transfer_params")
    except (ValueError, AttributeError) as exc:
        raise RouterError(502, f"native prefill {prefill_url} answered 200 without a JSON object: {exc}", type="prefill_error",
                          code="native_prefill_bad_response") from exc
    if not kv_params:
        raise RouterError(502, f"native prefill {prefill_url} returned no kv_transfer_params: is it started with "
                          "NixlConnector as kv_producer (or kv_both)?", type="prefill_error", code="native_prefill_no_kv_params")
    body["kv_transfer_params"] = kv_params
    try:
        return await state.client.stream("POST", f"{decode_url}{path}", body=body, headers=up_headers,
                                         connect_patience_s=NATIVE_CONNECT_PATIENCE_S)
    except UpstreamError as exc:
        raise RouterError(502, f"native decode {decode_url} unreachable: {exc}", type="decode_node_error",
                          code="native_decode_unreachable") from exc


async def serve_native(state: RouterState, path: str, body: dict[str, Any], request_id: str, headers: dict[str, str],
                       timeline: Timeline | None = None, on_done: Callable[[int, str, float | None], None] | None = None) -> Response:
    """Prefill then decode on the native pool; returns the decode instance's response (streamed when asked).
    `on_done(status, outcome, t_end)` is called after the last byte (a stream: when the relay ends; `t_end` is when
    its last chunk went to the server, None: now), `timeline` gets the phases
    (`native_prefill`, `native_decode`) and sets the response's `Server-Timing` (a stream's: the prefill only)."""
    body = {k: v for k, v in body.items() if k != "kv_transfer_params"}  # clients never set these
    dresp = await native_stream(state, path, body, request_id, timeline)
    out_headers = {k: v for k, v in dresp.headers.items() if k.lower() not in _HOP_HEADERS}
    out_headers.update(headers)
    if not body.get("stream"):
        try:
            raw = await dresp.aread()
        except UpstreamError as exc:
            if timeline is not None:
                timeline.upto("native_decode")
            raise RouterError(502, f"native decode broke off: {exc}", type="decode_node_error",
                              code="native_decode_broken") from exc
        finally:
            await dresp.aclose()
        if timeline is not None:
            timeline.upto("native_decode")
        if on_done is not None:
            on_done(dresp.status, "ok", None)
        if timeline is not None:
            out_headers["server-timing"] = timeline.server_timing()
        return Response(raw, status_code=dresp.status, headers=out_headers)
    if timeline is not None:
        out_headers["server-timing"] = timeline.server_timing(partial=True)

    async def relay() -> AsyncIterator[bytes]:
        outcome = "disconnected"
        last_out: float | None = None  # when the last chunk went to the server: the client may hold it all before the
        try:  # upstream's end is read and this generator resumes
            async for chunk in dresp.chunks():
                last_out = time.perf_counter()
                yield chunk
            outcome = "ok"
        except UpstreamError:
            outcome = "error:native_decode_broken"
            raise
        finally:
            end = last_out if outcome == "ok" else None
            if timeline is not None:
                timeline.upto("native_decode", end=end)
            if on_done is not None:
                on_done(dresp.status, outcome, end)
            state.spawn(dresp.aclose())  # no await here: this may run inside a cancelled request

    return StreamingResponse(relay(), status_code=dresp.status, headers=out_headers)

