"""The router's HTTP client for its upstreams: vLLM prefill, tilepd decode nodes, the native pool.

aiohttp rather than httpx: one small JSON POST costs the caller about 0.3 ms of CPU with
aiohttp and 1.2-1.3 ms with httpx's async client (its anyio layers) on the 2-core dev box,
and the router makes two such calls per request and reads every token through this client
(docs/PERFORMANCE.md, router overhead).

Every failure to reach an upstream, a timeout, or a stream that breaks mid-way becomes an
`UpstreamError`, so the flows above handle one exception type. Only the TCP connect is
retried: a request whose bytes may have left is never sent twice.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

# Idle connections are dropped before the upstream's own keep-alive timeout (uvicorn's default,
# which vLLM and the decode node use, is 5 s), so a reused connection is never one the server
# is closing at that moment.
KEEPALIVE_S = 3.0
RETRY_BACKOFF_S = 0.5
MAX_BACKOFF_S = 2.0


class UpstreamError(Exception):
    """The upstream could not be reached, timed out, or broke off; the message names the cause."""

    def __init__(self, url: str, exc: BaseException) -> None:
        self.url = url
        self.cause = exc
        detail = str(exc) or ("no answer in time" if isinstance(exc, asyncio.TimeoutError) else "no detail")
        super().__init__(f"{type(exc).__name__}: {detail}")


@dataclass(frozen=True)
class UpstreamResponse:
    """A response read whole."""

    status: int
    headers: Mapping[str, str]
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


class UpstreamStream:
    """A response whose body is read as it arrives; `aclose()` it in every case."""

    def __init__(self, url: str, resp: aiohttp.ClientResponse) -> None:
        self._url = url
        self._resp = resp
        self.status = resp.status
        self.headers: Mapping[str, str] = resp.headers

    @property
    def is_closed(self) -> bool:
        return self._resp.closed

    async def aread(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamError(self._url, exc) from exc
        finally:
            self._resp.release()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: whatever one read returned, so several lines cost one wake-up."""
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamError(self._url, exc) from exc

    async def aclose(self) -> None:
        """Drop the connection unless the body was read to its end (then it goes back to the pool)."""
        if not self._resp.closed:
            self._resp.close()


class Upstream:
    """One connection pool for every upstream; created lazily inside the running event loop."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, connect_retries: int = 2,
                 max_connections: int = 4096, auth_by_base_url: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s,
                                              sock_read=read_timeout_s)
        self._retries = connect_retries
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        # headers every call under a base URL carries (the deployment's vLLM servers: their API key)
        self._auth = {base.rstrip("/") + "/": dict(h) for base, h in (auth_by_base_url or {}).items() if h}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEPALIVE_S)
            # json.dumps without spaces is what httpx sent; auto_decompress: relayed bodies are plain bytes
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, auto_decompress=True,
                                                  json_serialize=lambda o: json.dumps(o, separators=(",", ":")))
        return self._session

    def _timeout_for(self, timeout_s: float | None) -> aiohttp.ClientTimeout:
        """`timeout_s` bounds each phase (connect, each read), not the whole call, as httpx's timeouts did:
        a total bound made health probes flap on a saturated host (a 1 s /health answer that
        took 0.6 s to connect and 0.6 s to arrive is slow, not dead)."""
        if timeout_s is None:
            return self._timeout
        return aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=timeout_s, sock_read=timeout_s)

    async def _send(self, method: str, url: str, body: Any, headers: Mapping[str, str] | None,
                    timeout_s: float | None, patience_s: float = 0.0) -> aiohttp.ClientResponse:
        """Retry the connect only (nothing was sent on a connection that never opened): `connect_retries` times, and
        on connect timeouts also for as long as `patience_s` since the first try (an upstream that takes no connection
        in time is overloaded: its accept queue full, or its host starved; one that refuses is down)."""
        auth = next((h for base, h in self._auth.items() if url.startswith(base)), None)
        headers = {**auth, **(headers or {})} if auth else headers
        attempt = 0
        loop = asyncio.get_running_loop()
        first = loop.time()
        while True:
            try:
                return await self._client().request(method, url, json=body, headers=headers, timeout=self._timeout_for(timeout_s))
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                attempt += 1
                patient = isinstance(exc, aiohttp.ConnectionTimeoutError) and loop.time() - first < patience_s
                if attempt > self._retries and not patient:
                    raise UpstreamError(url, exc) from exc
                # at once, then 0.5 s, 1 s, ... (as httpcore does), at most 2 s apart while patient
                await asyncio.sleep(min(RETRY_BACKOFF_S * (attempt - 1), MAX_BACKOFF_S))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise UpstreamError(url, exc) from exc

    async def request(self, method: str, url: str, *, body: Any = None, headers: Mapping[str, str] | None = None,
                      timeout_s: float | None = None, connect_patience_s: float = 0.0) -> UpstreamResponse:
        """Send and read the whole response; `timeout_s` bounds the connect and each read (default: the pool's);
        `connect_patience_s`: how long connect timeouts are retried (see `_send`)."""
        resp = await self._send(method, url, body, headers, timeout_s, connect_patience_s)
        try:
            content = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamError(url, exc) from exc
        finally:
            resp.release()
        return UpstreamResponse(resp.status, resp.headers, content)

    async def stream(self, method: str, url: str, *, body: Any = None, headers: Mapping[str, str] | None = None,
                     connect_patience_s: float = 0.0) -> UpstreamStream:
        """Send and return once the status line and headers are in; the body is read from the stream."""
        return UpstreamStream(url, await self._send(method, url, body, headers, None, connect_patience_s))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
