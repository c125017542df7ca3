"""HTTP calls to the router's upstreams: vLLM prefill and tilepd decode nodes.

Errors are classified here so the flows above stay linear: a prefill error is passed
through with vLLM's own status and body; a decode-node error becomes a
`DecodeNodeError` carrying the node's error code (see INTERFACES §4).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tilepd.contracts.decode_http import CancelBody
from tilepd.contracts.marker import handoff_result
from tilepd.router.errors import PassThroughError, RouterError
from tilepd.router.health import says_draining
from tilepd.router.logprobs import token_id
from tilepd.router.upstream import Upstream, UpstreamError, UpstreamStream



@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    prompt_tokens: int
    finish_reason: str  # "stop" when the first token already ends the request
    choice: dict[str, Any] | None = None  # vLLM's choice, for the first token's logprobs
    handoff: dict[str, Any] | None = None  # the connector's `tilepd_handoff` (state sending / refused / not_sent)


class DecodeNodeError(Exception):
    """The decode node refused or failed; `status` is its HTTP status (0: unreachable)."""

    def __init__(self, node: str, status: int, code: str, message: str, retry_after: str | None = None) -> None:
        super().__init__(f"decode node {node}: {status} {code}: {message}")
        self.node = node
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after

    def to_router_error(self) -> RouterError:
        """Clients see a typed OpenAI-style error; 5xx for node faults, the node's 4xx for bad parameters."""
        if self.status in (400, 501):
            return RouterError(self.status, self.message, type="invalid_request_error" if self.status == 400 else "not_implemented",
                               code=self.code, param=None)
        if self.status == 504:
            return RouterError(504, f"decode node {self.node}: {self.message}", type="upstream_timeout", code=self.code)
        return RouterError(502, f"decode node {self.node} failed: {self.code}: {self.message}", type="decode_node_error", code=self.code or "decode_node_error")


async def prefill_first_token(client: Upstream, url: str, body: dict[str, Any], request_id: str,
                              headers: dict[str, str] | None = None) -> PrefillResult:
    """POST /v1/completions with max_tokens=1; read the first token id from the logprobs."""
    try:
        resp = await client.request("POST", f"{url}/v1/completions", body=body, headers={"x-request-id": request_id, **(headers or {})})
    except UpstreamError as exc:
        raise RouterError(502, f"prefill {url} unreachable: {exc}", type="prefill_error", code="prefill_unreachable") from exc
    if resp.status != 200:
        raise PassThroughError(resp.status, resp.content, resp.headers.get("content-type", "application/json"))
    try:
        data = resp.json()
        choice = data["choices"][0]
        return PrefillResult(token_id(choice["logprobs"]["tokens"][0]), int(data["usage"]["prompt_tokens"]), choice.get("finish_reason") or "length",
                             choice, handoff_result(data))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise RouterError(502, f"prefill {url} answered without a first token id: {exc}", type="prefill_error", code="prefill_bad_response") from exc


async def open_decode(client: Upstream, node: str, base_url: str, body: dict[str, Any], request_id: str,
                      headers: dict[str, str] | None = None) -> UpstreamStream:
    """Start a streamed /v1/decode; raise DecodeNodeError unless the node answered 200."""
    try:
        resp = await client.stream("POST", f"{base_url}/v1/decode", body=body, headers={"x-request-id": request_id, **(headers or {})})
    except UpstreamError as exc:
        raise DecodeNodeError(node, 0, "unreachable", str(exc)) from exc
    if resp.status != 200:
        try:
            raw = await resp.aread()
        except UpstreamError as exc:
            raw = str(exc).encode()
        await resp.aclose()
        code, message = _error_fields(raw)
        raise DecodeNodeError(node, resp.status, code, message, resp.headers.get("retry-after"))
    return resp


_TOKEN_PREFIX = b'{"token": '


def parse_line(line: bytes) -> dict[str, Any]:
    """One NDJSON line; the per-token shape `{"token": N}` is parsed without the JSON machinery."""
    if line.startswith(_TOKEN_PREFIX) and line.endswith(b"}"):
        try:
            return {"token": int(line[len(_TOKEN_PREFIX):-1])}
        except ValueError:
            pass
    return json.loads(line)


class ReadWatch:
    """When the reader of a decode stream is waiting on the node (not on its own consumer).

    `waiting_since` is set while a read is pending and cleared as a chunk arrives, so a
    watchdog can tell a silent node from a slow client; `on_chunk` sees each chunk's wait.
    """

    waiting_since: float | None = None

    def on_chunk(self, waited_s: float, chunk: bytes) -> None:
        """Called with how long the read waited and what it got."""


async def decode_lines(node: str, resp: UpstreamStream, watch: ReadWatch | None = None) -> AsyncIterator[dict[str, Any]]:
    """The NDJSON lines of a decode stream, parsed; several lines in one read cost one wake-up."""
    pending = b""
    watch = watch or ReadWatch()
    try:
        chunks = resp.chunks().__aiter__()
        while True:
            watch.waiting_since = t = time.monotonic()
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            watch.waiting_since = None
            watch.on_chunk(time.monotonic() - t, chunk)
            pending += chunk
            if b"\n" not in chunk:
                continue
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line:
                    yield parse_line(line)
        if pending.strip():
            yield parse_line(pending.strip())
    except UpstreamError as exc:
        raise DecodeNodeError(node, 0, "stream_broken", str(exc)) from exc


async def join_decode(client: Upstream, base_url: str, body: dict[str, Any], request_id: str, timeout_s: float,
                      headers: dict[str, str] | None = None) -> int | None:
    """A non-streamed /v1/decode whose output is thrown away (joins a transfer to free its slot); the status, None if unreachable."""
    try:
        resp = await client.request("POST", f"{base_url}/v1/decode", body=body, headers={"x-request-id": request_id, **(headers or {})},
                                    timeout_s=timeout_s)
    except UpstreamError:
        return None
    return resp.status


async def cancel_decode(client: Upstream, base_url: str, transfer_id: str, timeout_s: float = 1.0,
                        headers: dict[str, str] | None = None, fence: int | None = None) -> bool:
    """POST /v1/cancel (of the reservation under `fence`, when given); True when the node acknowledged."""
    body = CancelBody(transfer_id=transfer_id, fence=fence).as_json() if fence is not None else CancelBody(transfer_id=transfer_id).as_json()
    try:
        resp = await client.request("POST", f"{base_url}/v1/cancel", body=body, timeout_s=timeout_s, headers=headers)
        return resp.status == 200
    except UpstreamError:
        return False


async def node_alive(client: Upstream, base_url: str, timeout_s: float) -> bool:
    """GET /health answered 200 within `timeout_s` (per phase), or 503 draining (alive: it finishes what it holds)."""
    try:
        resp = await client.request("GET", f"{base_url}/health", timeout_s=timeout_s)
        return resp.status == 200 or says_draining(resp)
    except UpstreamError:
        return False


async def node_status(client: Upstream, base_url: str, timeout_s: float = 1.0) -> dict[str, Any] | None:
    try:
        resp = await client.request("GET", f"{base_url}/status", timeout_s=timeout_s)
        return resp.json() if resp.status == 200 else None
    except (UpstreamError, ValueError):
        return None


def _error_fields(raw: bytes) -> tuple[str, str]:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("code") or "error"), str(err.get("message") or "")
    except (ValueError, KeyError, TypeError):
        return "error", raw[:500].decode("utf-8", "replace")
