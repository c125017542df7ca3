"""CPU per upstream call: the router's client (`tilepd.router.upstream.Upstream`, aiohttp) vs httpx's
AsyncClient, side by side in one run against one real uvicorn server (a JSON POST the size of a
prefill request, as the router sends two per request). Why the router uses aiohttp.

    .venv/bin/python bench/upstream_client_cost.py --calls 2000

The server runs on CPU 1 and the clients on CPU 0 when the machine has 2 or more CPUs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
import uvloop

from tilepd.contracts.marker import TilepdMarker

SERVER = """
import uvicorn
from fastapi import FastAPI, Request
app = FastAPI()
@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    return {"choices": [{"logprobs": {"tokens": ["token_id:42"]}}], "usage": {"prompt_tokens": len(body["prompt"])}}
uvicorn.run(app, host="127.0.0.1", port=%d, loop="uvloop", http="httptools", log_level="warning", access_log=False)
"""
BODY = {"model": "m", "prompt": list(range(12)), "max_tokens": 1, "stream": False, "logprobs": 1,
        "kv_transfer_params": TilepdMarker(host="10.0.0.1", ctrl_port=7000, transfer_id="tx-" + "0" * 32, token="f" * 32).as_params()}


async def per_call(call: Callable[[], Awaitable[object]], calls: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per call, after one warm-up call that opens the connection."""
    await call()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await call()
    return (time.process_time() - c0) / calls, (time.perf_counter() - w0) / calls


async def with_httpx(url: str, calls: int) -> tuple[float, float]:
    async with httpx.AsyncClient() as client:
        async def call() -> object:
            return (await client.post(url, json=BODY)).json()

        return await per_call(call, calls)


async def with_upstream(url: str, calls: int) -> tuple[float, float]:
    from tilepd.router.upstream import Upstream

    up = Upstream(connect_timeout_s=5.0, read_timeout_s=60.0)
    try:
        async def call() -> object:
            return (await up.request("POST", url, body=BODY)).json()

        return await per_call(call, calls)
    finally:
        await up.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the two clients this many times")
    args = ap.parse_args()
    from tilepd.connector.launch import free_port

    port = free_port()
    split = (os.cpu_count() or 1) >= 2
    server = subprocess.Popen([sys.executable, "-c", SERVER % port],
                              preexec_fn=(lambda: os.sched_setaffinity(0, {1})) if split else None)
    if split:
        os.sched_setaffinity(0, {0})
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.post(url, json=BODY, timeout=1.0)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        results: dict[str, list[tuple[float, float]]] = {"httpx AsyncClient": [], "router Upstream (aiohttp)": []}
        for _ in range(args.rounds):
            results["httpx AsyncClient"].append(uvloop.run(with_httpx(url, args.calls)))
            results["router Upstream (aiohttp)"].append(uvloop.run(with_upstream(url, args.calls)))
    finally:
        server.terminate()
        server.wait(10)
    print(f"{args.calls} JSON POSTs x {args.rounds} rounds, client {'on CPU 0, server on CPU 1' if split else 'and server unpinned'}")
    best = {name: min(r[0] for r in runs) for name, runs in results.items()}
    for name, runs in results.items():
        print(f"{name:28} client CPU {best[name] * 1e6:7.0f} us/call   wall {min(r[1] for r in runs) * 1e6:7.0f} us/call (best round)")
    print(f"ratio httpx / router client CPU per call: {best['httpx AsyncClient'] / best['router Upstream (aiohttp)']:.2f}")


if __name__ == "__main__":
    main()
