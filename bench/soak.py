"""Bounded soak of a whole local deployment with faults on a schedule (issue 13, part 6).

Brings up a local topology (everything on 127.0.0.1, `services: process`, tiny generated Llama):
a vLLM prefill with the tilepd connector (+ the stock NixlConnector under MultiConnector when the
native pool is on), two tilepd decode nodes, optionally a native vLLM decode, and the router. Then
`--clients` concurrent streaming clients (the stock `openai` SDK) send chat requests for
`--duration-s`, a share of them to the native pool (header `x-tilepd-latency-class: native`), some
of them dropping their stream early, while faults hit the decode nodes on a schedule:

  kill   SIGKILL of a decode node's process group, then `tilepd up` brings it back
  stop   SIGSTOP of a decode node for `--stop-s` seconds, then SIGCONT

Every request ends in exactly one bucket: completed (a finish_reason arrived), dropped (the client
closed it on purpose), typed error (an HTTP status or an error event with a code: the client was told),
or lost (connection error, timeout, a stream that ended without finish_reason: the client was not told).
fds, threads and RSS of the long-lived processes (router, prefill) are sampled after warm-up and at
the end; growth past the stated bounds fails the run.

Traffic goes to 127.0.0.1 only; every loop is bounded in time and count. Exit 0 only when lost == 0
and no bound was crossed. Usage: `bash scripts/soak.sh [--duration-s 300 --clients 6 ...]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Tell me a short story about a fast robot.",
    "What is the capital of France?",
    "Count from one to twelve.",
    "Describe the weather today in the hills.",
    "Please tell me a short story about a cat and a mouse.",
    "Why do programs get written for people to read?",
]
# Growth allowed between warm-up and the end, per long-lived process (router, prefill + children).
FD_GROWTH_MAX = 64
THREAD_GROWTH_MAX = 32
RSS_GROWTH_MAX_MB = 256.0


def topology_yaml(base: Path, ports: int, native: bool) -> str:
    """The soak deployment: two decode nodes (tcp, or nixl when a native pool shares the prefill)."""
    transport = "nixl" if native else "tcp"
    native_block = f"""
native_decode:
  - name: n0
    address: 127.0.0.1
    gpus: 0
    port: {ports + 200}
    enforce_eager: true
    nixl_side_channel_port: {ports + 201}
    extra_args: ["--dtype", "float32"]
    env: {{VLLM_CPU_KVCACHE_SPACE: "1"}}
""" if native else ""
    prefill_nixl = f"\n    nixl_side_channel_port: {ports + 101}" if native else ""
    return f"""apiVersion: tilepd/v1
deployment:
  name: soak
  base_dir: {base}
  services: process
  python: current
model:
  served_name: tiny-llama
  family: llama
  hf_path: {base}/models/tiny-llama
  weights_path: {base}/models/tiny-llama-tilepd
  max_seq_len: 2048
  generate_tiny: llama
transport:
  name: {transport}
prefill:
  - name: p0
    address: 127.0.0.1
    gpus: 0
    port: {ports + 100}
    enforce_eager: true{prefill_nixl}
    extra_args: ["--dtype", "float32"]
    env: {{VLLM_CPU_KVCACHE_SPACE: "1"}}
decode:
  - name: d0
    address: 127.0.0.1
    gpu: {{type: cpu}}
    ctrl_port: {ports + 10}
    http_port: {ports + 11}
    data_port: {ports + 12}
  - name: d1
    address: 127.0.0.1
    gpu: {{type: cpu}}
    ctrl_port: {ports + 20}
    http_port: {ports + 21}
    data_port: {ports + 22}
{native_block}
router:
  name: router
  address: 127.0.0.1
  port: {ports}
  queue_timeout_s: 5.0
  routing: {{fallback_to_native: {str(native).lower()}}}
"""


def tilepd(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("tilepd")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout)


def service_pid(base: Path, name: str) -> int | None:
    """Main pid of a process-mode service from its state file (None when it is not running)."""
    state = base / "run" / f"{name}.state.json"
    for path in [state, *base.rglob(f"{name}.state.json")]:
        if path.is_file():
            pid = int(json.loads(path.read_text())["pid"])
            return pid if psutil.pid_exists(pid) else None
    return None


def usage(pid: int) -> dict[str, float]:
    """fds, threads and RSS (MB) of a process and all its descendants."""
    out = {"fds": 0.0, "threads": 0.0, "rss_mb": 0.0}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            out["fds"] += p.num_fds()
            out["threads"] += p.num_threads()
            out["rss_mb"] += p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return out


@dataclass
class Tally:
    completed: int = 0
    dropped: int = 0
    typed: int = 0
    lost: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: {"low_latency": [], "native": []})
    ttft: list[float] = field(default_factory=list)
    typed_codes: dict[str, int] = field(default_factory=dict)
    lost_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return self.completed + self.dropped + self.typed + self.lost


async def one_request(client: openai.AsyncOpenAI, rng: random.Random, tally: Tally, native_share: float, drop_share: float,
                      timeout_s: float) -> None:
    pool = "native" if rng.random() < native_share else "low_latency"
    drop_after = rng.randint(1, 4) if rng.random() < drop_share else None
    t0 = time.monotonic()
    finish, chunks = None, 0
    try:
        async with asyncio.timeout(timeout_s):
            stream = await client.chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": rng.choice(PROMPTS)}],
                max_tokens=rng.randint(8, 48), temperature=0, stream=True,
                extra_headers={"x-tilepd-latency-class": pool})
            async for chunk in stream:
                if chunks == 0:
                    tally.ttft.append(time.monotonic() - t0)
                chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if drop_after is not None and chunks >= drop_after and finish is None:
                    await stream.close()
                    tally.dropped += 1
                    return
    except openai.APIStatusError as e:
        tally.typed += 1
        code = str((e.body or {}).get("code") if isinstance(e.body, dict) else e.status_code)
        tally.typed_codes[code] = tally.typed_codes.get(code, 0) + 1
        return
    except openai.APIError as e:  # an error event inside the stream (typed) or a broken connection (lost)
        if isinstance(e, (openai.APIConnectionError, openai.APITimeoutError)) or not getattr(e, "body", None):
            tally.lost += 1
            tally.lost_reasons[type(e).__name__] = tally.lost_reasons.get(type(e).__name__, 0) + 1
        else:
            tally.typed += 1
            code = str(e.body.get("code") if isinstance(e.body, dict) else "error_event")
            tally.typed_codes[code] = tally.typed_codes.get(code, 0) + 1
        return
    except TimeoutError:
        tally.lost += 1
        tally.lost_reasons["client_timeout"] = tally.lost_reasons.get("client_timeout", 0) + 1
        return
    if finish is None:
        tally.lost += 1
        tally.lost_reasons["no_finish_reason"] = tally.lost_reasons.get("no_finish_reason", 0) + 1
        return
    tally.completed += 1
    tally.latencies[pool].append(time.monotonic() - t0)


async def client_loop(idx: int, base_url: str, deadline: float, tally: Tally, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed * 1000 + idx)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=args.request_timeout_s)
    sent = 0
    while time.monotonic() < deadline and sent < args.max_requests_per_client:
        await one_request(client, rng, tally, args.native_share, args.drop_share, args.request_timeout_s)
        sent += 1
    await client.close()


async def fault_loop(base: Path, topo: Path, deadline: float, args: argparse.Namespace, log: list[str]) -> None:
    """kill d0 (then `tilepd up`), stop d1 for stop_s, alternating, every fault_every_s."""
    kinds = ["kill", "stop"]
    n = 0
    while True:
        await asyncio.sleep(args.fault_every_s)
        if time.monotonic() + args.stop_s + 5 > deadline:
            return
        kind = kinds[n % 2]
        node = "d0" if kind == "kill" else "d1"
        pid = service_pid(base, f"decode-{node}")  # the planner names a decode node's service decode-<node>
        if pid is None:
            log.append(f"{time.strftime('%H:%M:%S')} {kind} {node}: not running, skipped")
            n += 1
            continue
        t0 = time.monotonic()
        if kind == "kill":
            os.killpg(os.getpgid(pid), signal.SIGKILL)
            up = await asyncio.to_thread(tilepd, "up", str(topo), "-y")
            log.append(f"{time.strftime('%H:%M:%S')} kill {node} (pid {pid}): `tilepd up` rc={up.returncode} "
                       f"in {time.monotonic() - t0:.1f} s")
        else:
            os.killpg(os.getpgid(pid), signal.SIGSTOP)
            try:
                await asyncio.sleep(args.stop_s)
            finally:
                os.killpg(os.getpgid(pid), signal.SIGCONT)
            log.append(f"{time.strftime('%H:%M:%S')} stop {node} (pid {pid}) for {args.stop_s:.0f} s, then SIGCONT")
        n += 1


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def soak(args: argparse.Namespace) -> int:
    base = Path(args.workdir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    topo = base / "soak.yaml"
    topo.write_text(topology_yaml(base, args.port_base, args.native))
    print(f"[soak] topology {topo}; `tilepd up` (first start builds the tiny model and starts vLLM)", flush=True)
    up = tilepd("up", str(topo), "-y")
    if up.returncode != 0:
        print(up.stdout[-4000:], up.stderr[-4000:], sep="\n")
        print(f"[soak] tilepd up failed (rc {up.returncode})")
        if not args.keep:
            print(f"[soak] tilepd down rc={tilepd('down', str(topo), '-y').returncode}")
        return 2
    base_url = f"http://127.0.0.1:{args.port_base}/v1"
    tally, faults = Tally(), []
    try:
        # Warm-up: a few requests on each route, then the baseline sample of the long-lived processes.
        warm = Tally()
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=args.request_timeout_s)
        for _ in range(3):
            await one_request(client, random.Random(0), warm, args.native_share, 0.0, args.request_timeout_s)
        await client.close()
        watched = {name: service_pid(base, name) for name in ("router", "p0")}
        before = {name: usage(pid) for name, pid in watched.items() if pid}
        print(f"[soak] warm-up {warm.completed}/{warm.requests} completed; baseline {json.dumps(before)}", flush=True)
        t_start = time.monotonic()
        deadline = t_start + args.duration_s
        await asyncio.gather(
            *(client_loop(i, base_url, deadline, tally, args) for i in range(args.clients)),
            fault_loop(base, topo, deadline, args, faults),
        )
        elapsed = time.monotonic() - t_start
        await asyncio.sleep(2.0)
        after = {name: usage(pid) for name, pid in watched.items() if pid}
    finally:
        if not args.keep:
            down = tilepd("down", str(topo), "-y")
            print(f"[soak] tilepd down rc={down.returncode}")
    for line in faults:
        print(f"[soak] fault {line}")
    bad = []
    for name, b in before.items():
        a = after.get(name, b)
        growth = {k: a[k] - b[k] for k in b}
        print(f"[soak] {name}: fds {b['fds']:.0f}->{a['fds']:.0f}, threads {b['threads']:.0f}->{a['threads']:.0f}, "
              f"rss {b['rss_mb']:.0f}->{a['rss_mb']:.0f} MB")
        if growth["fds"] > FD_GROWTH_MAX or growth["threads"] > THREAD_GROWTH_MAX or growth["rss_mb"] > RSS_GROWTH_MAX_MB:
            bad.append(f"{name} grew {growth} (bounds fds {FD_GROWTH_MAX}, threads {THREAD_GROWTH_MAX}, rss {RSS_GROWTH_MAX_MB} MB)")
    for pool, lat in tally.latencies.items():
        if lat:
            print(f"[soak] {pool}: {len(lat)} completed, latency p50 {pct(lat, 0.5):.2f} s, p99 {pct(lat, 0.99):.2f} s")
    if tally.ttft:
        print(f"[soak] time to first chunk p50 {pct(tally.ttft, 0.5):.2f} s, p99 {pct(tally.ttft, 0.99):.2f} s")
    print(f"[soak] typed error codes {tally.typed_codes}; lost reasons {tally.lost_reasons}; dropped by clients {tally.dropped}")
    rate = tally.requests / elapsed if elapsed else 0.0
    print(f"[soak] {elapsed:.0f} s, {args.clients} clients, {rate:.2f} req/s, faults {len(faults)}, "
          f"mean latency {statistics.fmean(sum(tally.latencies.values(), [])) if tally.completed else float('nan'):.2f} s")
    print(f"soak: requests {tally.requests} / completed {tally.completed} / typed errors {tally.typed} / lost = {tally.lost}")
    skipped = [line for line in faults if line.endswith("skipped")]
    if skipped:  # a soak whose faults did not happen proves nothing about them
        bad.append(f"{len(skipped)} of {len(faults)} faults were not injected (no running process found)")
    for line in bad:
        print(f"[soak] BOUND CROSSED: {line}")
    return 0 if tally.lost == 0 and not bad else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-requests-per-client", type=int, default=2000)
    ap.add_argument("--fault-every-s", type=float, default=45.0)
    ap.add_argument("--stop-s", type=float, default=15.0)
    ap.add_argument("--native", action=argparse.BooleanOptionalAction, default=True, help="add a native vLLM decode pool")
    ap.add_argument("--native-share", type=float, default=0.2)
    ap.add_argument("--drop-share", type=float, default=0.1)
    ap.add_argument("--request-timeout-s", type=float, default=180.0)
    ap.add_argument("--port-base", type=int, default=19000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="/tmp/tilepd-soak")
    ap.add_argument("--keep", action="store_true", help="leave the stack running afterwards")
    args = ap.parse_args()
    if not args.native:
        args.native_share = 0.0
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
