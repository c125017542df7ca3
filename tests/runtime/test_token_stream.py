"""TokenStream: the engine thread's tokens reach the HTTP stream in order, coalesced, never lost."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

from tilepd.runtime.token_stream import TokenStream, ndjson_line


async def _read_all(stream: TokenStream, timeout: float = 20.0) -> list[bytes]:
    chunks: list[bytes] = []
    while True:
        kind, chunk = await asyncio.wait_for(stream.get(), timeout)
        if kind == "end":
            assert chunk is None
            return chunks
        assert kind == "token" and chunk
        chunks.append(chunk)


def _lines(chunks: list[bytes]) -> list[object]:
    return [json.loads(line) for c in chunks for line in c.decode().splitlines()]


def test_lines_are_what_json_dumps_writes() -> None:
    assert ndjson_line(7) == (json.dumps({"token": 7}) + "\n").encode()
    entry = {"token": 3, "logprob": -0.5, "top_logprobs": [{"token": 3, "logprob": -0.5}]}
    assert ndjson_line(entry) == (json.dumps(entry) + "\n").encode()


def test_tokens_pushed_before_the_read_come_as_one_chunk() -> None:
    async def main() -> list[bytes]:
        s = TokenStream(asyncio.get_running_loop())
        for t in range(100):
            s.push(t)
        s.close()
        return await _read_all(s)

    chunks = asyncio.run(main())
    assert len(chunks) == 1 and _lines(chunks) == [{"token": t} for t in range(100)]


def test_a_producer_thread_racing_the_reader_loses_nothing() -> None:
    """Many short bursts with random gaps: every wake-up race between 'reader about to wait' and 'producer
    pushes' is hit many times; a lost wake-up would hang (wait_for fails the test instead)."""
    n = 5000
    rng = random.Random(0)
    gaps = [0.0 if rng.random() < 0.8 else rng.random() * 2e-4 for _ in range(n)]

    async def main() -> list[bytes]:
        s = TokenStream(asyncio.get_running_loop())

        def produce() -> None:
            for t, gap in enumerate(gaps):
                s.push(t if t % 7 else {"token": t, "logprob": -1.0})
                if gap:
                    time.sleep(gap)
            s.close()

        th = threading.Thread(target=produce)
        th.start()
        try:
            return await _read_all(s)
        finally:
            th.join()

    chunks = asyncio.run(main())
    got = _lines(chunks)
    assert [x["token"] for x in got] == list(range(n))  # type: ignore[index]
    assert all(("logprob" in x) == (x["token"] % 7 == 0) for x in got)  # type: ignore[index,operator]
    assert 1 < len(chunks) < n  # waited at least once, and coalesced some


def test_a_push_after_the_reader_was_cancelled_is_harmless() -> None:
    async def main() -> None:
        s = TokenStream(asyncio.get_running_loop())
        reader = asyncio.ensure_future(s.get())
        await asyncio.sleep(0.01)  # the reader waits
        reader.cancel()
        await asyncio.sleep(0)
        s.push(1)  # wakes a cancelled future: nothing happens
        await asyncio.sleep(0.01)
        assert await s.get() == ("token", b'{"token": 1}\n')

    asyncio.run(main())
