"""The router's upstream client against real sockets: what is retried, what is not, and what errors say."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tilepd.connector.launch import free_port
from tilepd.router.upstream import Upstream, UpstreamError


async def _serve(port: int, handler) -> asyncio.base_events.Server:
    return await asyncio.start_server(handler, "127.0.0.1", port)


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    return head + await reader.readexactly(length)


def _answers_ok(seen: list[bytes]):  # noqa: ANN202 - an asyncio.start_server handler
    """A handler that records each request and answers 200 {"ok": true}."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await _read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{\"ok\": true}")
        await writer.drain()
        writer.close()

    return handler


def test_refused_connect_is_retried_until_the_upstream_listens() -> None:
    """Nothing listens at first (the port is bound, not listening: connects are refused); the listener opens between
    the retries (at once, then 0.5 s later). It listens on the socket bound beforehand, so opening it needs no
    address lookup in an executor thread, which on a loaded box once took past the 0.5 s retry (CI: refused 3 times)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    seen: list[bytes] = []

    handler = _answers_ok(seen)

    async def main() -> dict:
        up = Upstream(connect_timeout_s=2.0, read_timeout_s=5.0, connect_retries=2)

        async def listen_later() -> asyncio.base_events.Server:
            await asyncio.sleep(0.2)
            return await asyncio.start_server(handler, sock=sock)

        later = asyncio.ensure_future(listen_later())
        try:
            resp = await up.request("POST", f"http://127.0.0.1:{port}/v1/x", body={"a": 1})
            return resp.json()
        finally:
            (await later).close()
            await up.aclose()

    assert asyncio.run(main()) == {"ok": True}
    assert len(seen) == 1 and b'{"a":1}' in seen[0]


def test_refused_connect_gives_up_after_the_retries_and_names_the_cause() -> None:
    port = free_port()

    async def main() -> None:
        up = Upstream(connect_timeout_s=1.0, read_timeout_s=1.0, connect_retries=1)
        try:
            await up.request("GET", f"http://127.0.0.1:{port}/health")
        finally:
            await up.aclose()

    with pytest.raises(UpstreamError, match="ClientConnectorError") as info:
        asyncio.run(main())
    assert str(port) in str(info.value)


def test_a_request_that_reached_the_upstream_is_never_sent_twice() -> None:
    """The upstream reads the request and drops the connection: an error, and exactly one request seen."""
    port = free_port()
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await _read_request(reader))
        writer.close()

    async def main() -> None:
        server = await _serve(port, handler)
        up = Upstream(connect_timeout_s=1.0, read_timeout_s=2.0, connect_retries=2)
        try:
            await up.request("POST", f"http://127.0.0.1:{port}/v1/completions", body={"prompt": "x"})
        finally:
            await up.aclose()
            server.close()

    with pytest.raises(UpstreamError, match="ServerDisconnectedError"):
        asyncio.run(main())
    assert len(seen) == 1


def test_a_stream_that_breaks_off_raises_upstream_error_after_the_chunks_it_sent() -> None:
    port = free_port()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"e\r\n{\"token\": 17}\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()  # mid-body, no terminating chunk

    async def main() -> list[bytes]:
        server = await _serve(port, handler)
        up = Upstream(connect_timeout_s=1.0, read_timeout_s=2.0)
        got: list[bytes] = []
        try:
            stream = await up.stream("POST", f"http://127.0.0.1:{port}/v1/decode", body={})
            assert stream.status == 200
            with pytest.raises(UpstreamError):
                async for chunk in stream.chunks():
                    got.append(chunk)
            await stream.aclose()
            assert stream.is_closed
        finally:
            await up.aclose()
            server.close()
        return got

    assert b"".join(asyncio.run(main())) == b'{"token": 17}\n'


def test_a_silent_upstream_times_out_within_the_call_bound() -> None:
    port = free_port()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)  # never answers in time
        writer.close()

    async def main() -> float:
        server = await _serve(port, handler)
        up = Upstream(connect_timeout_s=1.0, read_timeout_s=30.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            with pytest.raises(UpstreamError, match="Timeout"):
                await up.request("POST", f"http://127.0.0.1:{port}/v1/cancel", body={}, timeout_s=0.3)
            return loop.time() - t0
        finally:
            await up.aclose()
            server.close()

    assert asyncio.run(main()) < 2.0


def _full_listener() -> tuple[socket.socket, socket.socket]:
    """A listening socket whose accept queue is full (backlog 0, one connection never accepted): further connects get
    no answer and time out, as with an overloaded server that stopped accepting."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    filler = socket.create_connection(srv.getsockname(), timeout=2)
    return srv, filler


def _counting_connects(up: Upstream) -> list[float]:
    """Record the time of each request the upstream client starts (each connect attempt, as nothing is pooled yet)."""
    starts: list[float] = []
    real = up._client

    class Counting:
        def request(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - delegates to aiohttp's
            starts.append(asyncio.get_running_loop().time())
            return real().request(*args, **kwargs)

    up._client = Counting  # type: ignore[method-assign] - _send calls self._client().request(...)
    return starts


def test_connect_timeouts_are_waited_out_with_patience_and_fail_fast_without() -> None:
    """The upstream takes no connection until the fourth connect attempt has begun, then serves: a call with 10 s of
    patience gets its answer, past the two attempts connect_retries allows; the default (patience 0, connect_retries 1)
    against an upstream that never accepts fails with the connect timeout after exactly two attempts, having sent
    nothing. Attempts are counted, not timed: on the loaded 2-core box this process was once starved for seconds."""
    seen: list[bytes] = []

    handler = _answers_ok(seen)

    async def main(patience_s: float, serve_at_attempt: int | None) -> tuple[dict | None, float, BaseException | None, int]:
        srv, filler = _full_listener()
        port = srv.getsockname()[1]
        up = Upstream(connect_timeout_s=0.3, read_timeout_s=5.0, connect_retries=1)
        starts = _counting_connects(up)

        async def serve_later() -> asyncio.base_events.Server | None:
            if serve_at_attempt is None:
                return None
            while len(starts) < serve_at_attempt:
                await asyncio.sleep(0.02)
            filler.close()
            return await asyncio.start_server(handler, sock=srv)

        later = asyncio.ensure_future(serve_later())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            resp = await up.request("POST", f"http://127.0.0.1:{port}/v1/x", body={"a": 1}, connect_patience_s=patience_s)
            return resp.json(), loop.time() - t0, None, len(starts)
        except UpstreamError as exc:
            return None, loop.time() - t0, exc, len(starts)
        finally:
            server = await later
            if server is not None:
                server.close()
            filler.close()
            srv.close()
            await up.aclose()

    got, took, err, attempts = asyncio.run(main(patience_s=10.0, serve_at_attempt=4))
    assert err is None and got == {"ok": True} and attempts >= 4, (took, err, attempts)  # the patience kept it trying
    assert len(seen) == 1
    got, took, err, attempts = asyncio.run(main(patience_s=0.0, serve_at_attempt=None))
    assert got is None and "ConnectionTimeoutError" in str(err) and attempts == 2, (took, err, attempts)
    assert len(seen) == 1  # nothing reached the upstream
