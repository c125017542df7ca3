"""`tilepd capacity` against a live stack (issue 17): predicted vs measured p99 queue wait at two load levels.

Brings up a local deployment through the operator path (`tilepd up FILE`, `tilepd down FILE` at the end,
always): topology_examples/local.yaml with TWO decode nodes, a short router `queue_timeout_s`, its own
ports (19xxx by default, checked free) and everything under `--workdir`. Then:

1. calibration: `nodes` closed-loop clients for `--calibrate-s` seconds; completions/s is the pool's
   capacity under full load (on a small CPU box the prefill shares cores with the decode nodes, so a
   node's service time grows with load: the saturated figure is the honest denominator);
2. per level (`--levels`, offered utilisation as fractions of that capacity): an open-loop Poisson load
   (exponential gaps, one fixed prompt, fixed `max_tokens` with `ignore_eos`, temperature 0) for
   `--level-s` seconds; after `--warmup-s` of it, `tilepd capacity FILE --window W --json` reads the
   router's /metrics twice W seconds apart. Every request's queue wait comes from the router's
   `Server-Timing` header (`queue_wait`), its status code too (429 = the router's `busy`).

Printed per level: which model `tilepd capacity` chose (independent nodes, or state-dependent when the router's
hold by busy level shows the nodes slowing each other down), offered req/s, measured utilisation, measured p99 queue wait (client side from
Server-Timing over the requests sent inside the capacity window, and the router histogram's as
`tilepd capacity` reports it), the current pool's predicted p99 (formula, simulation) and
predicted/measured. A level passes when both predictions are within `--bound` (25%) of the
client-side p99; exit 0 only when every level passes (1: a level missed, 2: the stack or a
command failed). Not a pytest test (minutes of real load):

    flock /tmp/tilepd-heavy.lock .venv/bin/python bench/capacity_check.py --out bench/results/capacity_check.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tilepd (and tests) first

from tilepd.router.timeline import parse_server_timing

REPO = Path(__file__).resolve().parents[1]

MODEL = "tiny-llama"
PROMPT = "Please tell me a short story about a cat and a mouse."


# ---------------------------------------------------------------- pure parts (tests/capacity/test_check_bench.py)
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), as the simulation's p99 is taken; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def compare(predicted: float | None, measured: float, bound: float) -> tuple[float, bool]:
    """predicted/measured and whether it is within `bound` (0.25 = 25%) of 1; a ~zero measured wait never passes
    (the relative comparison means nothing without queueing)."""
    if predicted is None or not math.isfinite(predicted) or not math.isfinite(measured) or measured < 1e-3:
        return math.nan, False
    ratio = predicted / measured
    return ratio, abs(ratio - 1.0) <= bound


@dataclass
class Sent:
    """One request of the open-loop load (times on this process's monotonic clock)."""

    t_send: float
    status: int = 0  # 0: no answer (connection error, timeout)
    queue_wait_s: float | None = None  # Server-Timing queue_wait
    admission_s: float = 0.0  # Server-Timing admission: arrival at the lease queue = t_send + this (+ the client's send)
    service_s: float | None = None  # Server-Timing phases between queue_wait and respond: ~ the node's lease hold
    latency_s: float = math.nan
    error: str = ""


def in_window(sent: list[Sent], start: float, end: float) -> list[Sent]:
    """The requests sent inside [start, end): the ones the router's two scrapes bracket (up to admission time)."""
    return [s for s in sent if start <= s.t_send < end]


def replay(sent: list[Sent], nodes: int, timeout_s: float) -> list[tuple[Sent, float]]:
    """Trace-driven FIFO: these requests' own arrivals and service times through `nodes` batch=1 nodes with the
    router's patience; the waits of the served. Matching the measured waits says the router queues as the model
    does, and a gap between them and the prediction comes from the arrivals/service times themselves (not i.i.d.)."""
    import heapq

    free = [-math.inf] * nodes
    waits: list[tuple[Sent, float]] = []
    for s in sorted(sent, key=lambda r: r.t_send + r.admission_s):
        t = s.t_send + s.admission_s
        start = max(t, free[0])
        if start - t > timeout_s or s.service_s is None:
            continue  # waited out the timeout (429), or no service time known: takes no node
        heapq.heapreplace(free, start + s.service_s)
        waits.append((s, start - t))
    return waits


def shuffled_replay_p99(sent: list[Sent], window: list[Sent], nodes: int, timeout_s: float, rounds: int = 20,
                        seed: int = 0) -> float:
    """The FIFO replay with the service times shuffled among the requests (same arrivals, same service-time
    distribution, but independent of time and of the pool's state): the model's own assumptions. Its p99 next
    to the plain replay's separates the model's error from the inputs' dependence (mean over `rounds`)."""
    rng = random.Random(seed)
    ids = {id(x) for x in window}
    out = []
    for _ in range(rounds):
        times = [x.service_s for x in sent if x.service_s is not None]
        rng.shuffle(times)
        it = iter(times)
        mixed = [Sent(x.t_send, x.status, x.queue_wait_s, x.admission_s, next(it) if x.service_s is not None else None) for x in sent]
        keep = {id(m) for m, x in zip(mixed, sent) if id(x) in ids}
        out.append(percentile([w for m, w in replay(mixed, nodes, timeout_s) if id(m) in keep], 0.99))
    return sum(out) / len(out) if out else math.nan


def service_by_company(sent: list[Sent]) -> dict[str, float]:
    """Mean service time of the requests that had the pool to themselves vs those that spent at least half their
    service next to another one: on a shared CPU box the second is much longer (nodes slow each other down),
    which an M/G/c model of independent nodes does not describe."""
    spans = sorted((x.t_send + x.admission_s + (x.queue_wait_s or 0.0), x.service_s) for x in sent
                   if x.status == 200 and x.service_s is not None)
    alone: list[float] = []
    shared: list[float] = []
    for i, (a, d) in enumerate(spans):
        b = a + d
        other = sum(max(0.0, min(b, a2 + d2) - max(a, a2)) for j, (a2, d2) in enumerate(spans[max(0, i - 20):i + 20], max(0, i - 20))
                    if j != i)
        frac = other / d if d > 0 else 0.0
        if frac < 0.01:
            alone.append(d)
        elif frac >= 0.5:
            shared.append(d)
    return {"alone_n": len(alone), "alone_mean_s": sum(alone) / len(alone) if alone else math.nan,
            "shared_n": len(shared), "shared_mean_s": sum(shared) / len(shared) if shared else math.nan}


def summarize(sent: list[Sent]) -> dict[str, Any]:
    """Client-side figures over some requests: counts by status, p99/mean queue wait of the served (200)."""
    ok = [s.queue_wait_s for s in sent if s.status == 200 and s.queue_wait_s is not None]
    by_status: dict[str, int] = {}
    for s in sent:
        by_status[str(s.status)] = by_status.get(str(s.status), 0) + 1
    busy = by_status.get("429", 0)
    return {"requests": len(sent), "by_status": by_status, "served_with_wait": len(ok),
            "p99_wait_s": percentile(ok, 0.99), "p50_wait_s": percentile(ok, 0.5),
            "mean_wait_s": sum(ok) / len(ok) if ok else math.nan,
            "p_wait": sum(1 for w in ok if w > 0.0005) / len(ok) if ok else math.nan,
            "busy_fraction": busy / len(sent) if sent else math.nan}


# ---------------------------------------------------------------- the stack
def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ports_of(base: int) -> list[int]:
    return [base, base + 100, base + 10, base + 11, base + 12, base + 20, base + 21, base + 22]


def topology_yaml(base: Path, port: int, queue_timeout_s: float, decode_threads: int = 0) -> str:
    """topology_examples/local.yaml with two decode nodes, its own ports and base dir, a short queue timeout.

    `decode_threads` > 0 caps each decode node's torch/OpenMP threads (OMP_NUM_THREADS): by default torch
    uses every core, so on a small CPU box two busy nodes halve each other's speed, which the M/G/c model
    (independent nodes, as on GPUs) does not describe."""
    denv = f"\n    env: {{OMP_NUM_THREADS: \"{decode_threads}\"}}" if decode_threads > 0 else ""
    return f"""apiVersion: tilepd/v1
deployment:
  name: capacity-check
  base_dir: {base}
  services: process
  python: current
model:
  served_name: {MODEL}
  family: llama
  hf_path: {base}/models/tiny-llama
  weights_path: {base}/models/tiny-llama-tilepd
  max_seq_len: 2048
  generate_tiny: llama
transport:
  name: tcp
prefill:
  - name: p0
    address: 127.0.0.1
    gpus: 0
    port: {port + 100}
    enforce_eager: true
    extra_args: ["--dtype", "float32"]
    env: {{VLLM_CPU_KVCACHE_SPACE: "1"}}
decode:
  - name: d0
    address: 127.0.0.1
    gpu: {{type: cpu}}
    ctrl_port: {port + 10}
    http_port: {port + 11}
    data_port: {port + 12}{denv}
  - name: d1
    address: 127.0.0.1
    gpu: {{type: cpu}}
    ctrl_port: {port + 20}
    http_port: {port + 21}
    data_port: {port + 22}{denv}
router:
  name: router
  address: 127.0.0.1
  port: {port}
  queue_timeout_s: {queue_timeout_s}
"""


def tilepd_argv(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("tilepd")
    return [str(exe), *args] if exe.exists() else [sys.executable, "-m", "tilepd", *args]


def tilepd(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(tilepd_argv(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO)


# ---------------------------------------------------------------- load
def body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": False}


async def one(client: httpx.AsyncClient, url: str, payload: dict[str, Any], rec: Sent) -> None:
    try:
        r = await client.post(url, json=payload)
        rec.status = r.status_code
        phases = parse_server_timing(r.headers.get("server-timing", ""))
        dur = phases.get("queue_wait", {}).get("dur")
        rec.queue_wait_s = dur / 1e3 if isinstance(dur, float) else None
        rec.admission_s = phases.get("admission", {}).get("dur", 0.0) / 1e3
        if r.status_code == 200:
            held = [v.get("dur", 0.0) for k, v in phases.items() if k not in ("admission", "queue_wait", "respond", "total", "other")]
            rec.service_s = sum(held) / 1e3
        if r.status_code not in (200, 429):
            rec.error = r.text[:200]
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.latency_s = time.monotonic() - rec.t_send


def hold_totals(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the router's lease-hold histogram: the nodes' service time so far."""
    from tilepd.capacity.sources import HOLD, scrape

    m = scrape(metrics_url)
    return m.total(f"{HOLD}_sum"), m.total(f"{HOLD}_count")


async def calibrate(client: httpx.AsyncClient, url: str, metrics_url: str, payload: dict[str, Any], nodes: int,
                    workers: int, seconds: float) -> dict[str, Any]:
    """`workers` closed-loop clients (more than the nodes: a node never waits for a client) for `seconds`.

    The pool's capacity is nodes / mean lease hold over that saturated stretch (the M/G/c service rate
    c/E[S]), not completions/s of a few clients: time outside the lease (admission, HTTP, the response)
    would leave nodes idle and understate it.
    """
    done: list[Sent] = []
    deadline = time.monotonic() + seconds

    async def loop() -> None:
        while time.monotonic() < deadline:
            rec = Sent(time.monotonic())
            await one(client, url, payload, rec)
            done.append(rec)

    s0, n0 = hold_totals(metrics_url)
    t0 = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(workers)))
    elapsed = time.monotonic() - t0
    s1, n1 = hold_totals(metrics_url)
    ok = [s for s in done if s.status == 200]
    lat = [s.latency_s for s in ok]
    hold = (s1 - s0) / (n1 - n0) if n1 > n0 else math.nan
    return {"seconds": elapsed, "workers": workers, "completed": len(ok), "failed": len(done) - len(ok),
            "throughput_rps": len(ok) / elapsed, "mean_hold_s": hold, "capacity_rps": nodes / hold,
            "latency_p50_s": percentile(lat, 0.5), "mean_latency_s": sum(lat) / len(lat) if lat else math.nan}


async def capacity_run(topo: Path, window_s: float, seed: int) -> tuple[dict[str, Any] | None, float, str]:
    """`tilepd capacity FILE --window W --json`; returns (its JSON, when its first scrape happened, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *tilepd_argv("capacity", str(topo), "--window", f"{window_s:g}", "--json", "--seed", str(seed),
                     "--target-p99-wait-s", "60"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO)
    assert proc.stderr is not None and proc.stdout is not None
    started = math.nan
    err_lines: list[str] = []
    while True:
        line = await proc.stderr.readline()
        if not line:
            break
        text = line.decode(errors="replace")
        err_lines.append(text)
        if text.startswith("reading ") and math.isnan(started):
            started = time.monotonic()  # printed right after the first scrape
    out = await proc.stdout.read()
    rc = await proc.wait()
    if rc not in (0, 1) or not out.strip():
        return None, started, f"rc {rc}: {''.join(err_lines)[-2000:]}"
    return json.loads(out), started, "".join(err_lines)


CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(stat_text: str) -> dict[str, float]:
    """The machine's CPU seconds by kind from /proc/stat's first line (all cores; USER_HZ is 100 on Linux)."""
    first = stat_text.splitlines()[0].split()
    if first[0] != "cpu":
        raise ValueError(f"not a /proc/stat text: {first[:2]}")
    return {name: int(v) / 100.0 for name, v in zip(CPU_FIELDS, first[1:])}


async def sample_cpu(every_s: float, out: list[list[float]], t0: float) -> None:
    """Every `every_s`: [seconds since t0, steal, busy (user+nice+system+irq+softirq), idle] since the level began. On a
    VM, steal is time the host gave this machine's cores to others: a slow stretch with steal is the host's, not ours."""
    def read() -> dict[str, float]:
        return cpu_times(Path("/proc/stat").read_text())

    try:
        base = read()
    except (OSError, ValueError):
        return  # not Linux: nothing to record
    while True:
        await asyncio.sleep(every_s)
        now = read()
        busy = sum(now[k] - base[k] for k in ("user", "nice", "system", "irq", "softirq"))
        out.append([round(time.monotonic() - t0, 2), round(now["steal"] - base["steal"], 2), round(busy, 2),
                    round(now["idle"] - base["idle"], 2)])


async def level(client: httpx.AsyncClient, url: str, payload: dict[str, Any], topo: Path, rate: float, seconds: float,
                warmup_s: float, seed: int, timeout_s: float, keep_trace: bool) -> dict[str, Any]:
    """Open-loop Poisson arrivals at `rate` for `seconds`; `tilepd capacity` covers the steady part."""
    rng = random.Random(seed)
    sent: list[Sent] = []
    tasks: list[asyncio.Task[None]] = []
    window_s = max(seconds - warmup_s - 3.0, 10.0)  # its start-up (~1-2 s) and the last scrape stay inside the load
    t0 = time.monotonic()
    cpu: list[list[float]] = []
    cpu_task = asyncio.create_task(sample_cpu(1.0, cpu, t0))
    cap_task = None
    t_next = t0
    while t_next < t0 + seconds:
        now = time.monotonic()
        if cap_task is None and now >= t0 + warmup_s:
            cap_task = asyncio.create_task(capacity_run(topo, window_s, seed))
        if t_next > now:
            await asyncio.sleep(t_next - now)
        rec = Sent(time.monotonic())
        sent.append(rec)
        tasks.append(asyncio.create_task(one(client, url, payload, rec)))
        t_next += rng.expovariate(rate)
    offered_s = time.monotonic() - t0
    if cap_task is None:
        cap_task = asyncio.create_task(capacity_run(topo, window_s, seed))
    await asyncio.gather(*tasks)
    cap, w_start, cap_err = await cap_task
    cpu_task.cancel()
    window = in_window(sent, w_start, w_start + window_s) if math.isfinite(w_start) else sent
    ids = {id(x) for x in window}  # replayed from the first request on, so the window starts with the queue it had
    replayed = percentile([w for x, w in replay(sent, 2, timeout_s) if id(x) in ids], 0.99)
    served = [x.service_s for x in window if x.service_s is not None]
    shuffled = shuffled_replay_p99(sent, window, 2, timeout_s, seed=seed)
    return {"rate_rps": rate, "offered_rps": len(sent) / offered_s, "replay_p99_wait_s": replayed,
            "shuffled_replay_p99_wait_s": shuffled, "service_by_company": service_by_company(window),
            "client_service_mean_s": sum(served) / len(served) if served else math.nan,
            "trace": [[round(x.t_send - t0, 4), x.status, x.queue_wait_s, round(x.admission_s, 4),
                       None if x.service_s is None else round(x.service_s, 4)] for x in sent] if keep_trace else None, "seconds": offered_s, "window_s": window_s,
            "window_start_s": w_start - t0 if math.isfinite(w_start) else None,
            "all": summarize(sent), "window": summarize(window), "capacity": cap, "capacity_stderr": cap_err[-2000:],
            "errors": sorted({s.error for s in sent if s.error})[:5],
            "host_cpu": {"fields": ["t_s", "steal_s", "busy_s", "idle_s"], "cumulative": cpu,
                         "steal_s": cpu[-1][1] if cpu else None}}


def verdict(lv: dict[str, Any], bound: float, timeout_s: float) -> dict[str, Any]:
    """The comparison of one level: client p99 (window) vs the current row's formula and simulation.

    A measured p99 at the queue timeout (>= 95% of it) says nothing: waits are capped there, so any
    overloaded prediction matches it; such a level does not pass."""
    cap = lv["capacity"] or {}
    cur = cap.get("current", {})
    meas = cap.get("measured", {})
    client_p99 = lv["window"]["p99_wait_s"]
    f_p99 = cur.get("formula", {}).get("p99_wait_s")
    s_p99 = cur.get("simulation", {}).get("p99_wait_s")
    f_ratio, f_ok = compare(f_p99, client_p99, bound)
    s_ratio, s_ok = compare(s_p99, client_p99, bound)
    hist_p99 = meas.get("p99_wait_s")
    return {"client_p99_wait_s": client_p99, "router_hist_p99_wait_s": hist_p99, "formula_p99_wait_s": f_p99,
            "simulation_p99_wait_s": s_p99, "formula_ratio": f_ratio, "simulation_ratio": s_ratio,
            "formula_vs_hist_ratio": compare(f_p99, hist_p99 if hist_p99 is not None else math.nan, bound)[0],
            "simulation_vs_hist_ratio": compare(s_p99, hist_p99 if hist_p99 is not None else math.nan, bound)[0],
            "utilisation": meas.get("utilisation"), "measured_rate_rps": meas.get("rate_per_s"),
            "model": cap.get("load", {}).get("model", "independent"),
            "service_by_busy": [(x["busy"], x["mean_s"], x["releases"]) for x in cap.get("load", {}).get("service_by_busy") or []],
            "work_cv": cap.get("load", {}).get("work_cv"), "work_cv_source": cap.get("load", {}).get("work_cv_source"),
            "alone_holds": meas.get("alone_holds"),
            "window_band": window_band(cap["load"], lv["window_s"], bound) if cap.get("load") else None,
            "measured_by_busy": meas.get("busy_levels"),
            "service_mean_s": cap.get("load", {}).get("service_mean_s"), "service_cv": cap.get("load", {}).get("service_cv"),
            "busy_fraction": meas.get("busy_fraction"), "formula_busy": cur.get("formula", {}).get("p_timeout"),
            "simulation_busy": cur.get("simulation", {}).get("p_timeout"),
            "p_wait": meas.get("p_wait"), "formula_p_wait": cur.get("formula", {}).get("p_wait"),
            "simulation_p_wait": cur.get("simulation", {}).get("p_wait"),
            "saturated": bool(math.isfinite(client_p99) and client_p99 >= 0.95 * timeout_s),
            "pass": bool(f_ok and s_ok and not (math.isfinite(client_p99) and client_p99 >= 0.95 * timeout_s))}


def window_band(load: dict[str, Any], window_s: float, bound: float, windows: int = 200, seed: int = 0) -> dict[str, Any] | None:
    """How far one window's p99 strays from the long run when the model is exactly right: the chosen model (its rate,
    service by busy level and work CV, or the service mean and CV as gamma) simulated over `windows` windows of the
    measured length. A queue's p99 rests on a few busy periods, so a 137 s window lands within 25% of the long run
    only 57-80% of the time at 0.5-0.7 utilisation: a miss inside this band is noise, not a wrong model."""
    from tilepd.capacity.simulate import MAX_REQUESTS, GammaTimes, simulate

    rate, timeout = load.get("rate_per_s"), load.get("queue_timeout_s")
    if not rate or not timeout:
        return None
    by_busy = [x["mean_s"] for x in load.get("service_by_busy") or []] or None
    service = GammaTimes(1.0, load["work_cv"]) if by_busy else GammaTimes(load["service_mean_s"], load["service_cv"])
    n = min(max(int(rate * window_s / 0.9), 1000), MAX_REQUESTS)  # the first 10% is the simulation's warm-up
    long_run = simulate(rate, service, 2, timeout, requests=min(100 * n, 500_000), seed=seed, by_busy=by_busy).p99_wait_s
    if not long_run > 0:
        return None
    ratios = sorted(simulate(rate, service, 2, timeout, requests=n, seed=seed + 1 + i, by_busy=by_busy).p99_wait_s / long_run
                    for i in range(windows))
    return {"windows": windows, "requests_per_window": n, "long_run_p99_wait_s": long_run,
            "p10": percentile(ratios, 0.10), "p90": percentile(ratios, 0.90),
            "within_bound": sum(abs(r - 1) <= bound for r in ratios) / windows}


def finite(v: Any) -> Any:
    """NaN/inf -> None, recursively (strict JSON)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v


def fmt_ms(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v * 1e3:.0f} ms"


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, spec)


async def drive(args: argparse.Namespace, topo: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port_base}/v1/chat/completions"
    metrics_url = f"http://127.0.0.1:{args.port_base}/metrics"
    payload = body(args.max_tokens)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    from tilepd.capacity.sources import RELEASES, scrape

    if RELEASES.removesuffix("_total") not in scrape(metrics_url).families:
        # the services run the tilepd their venv imports, which need not be this checkout (an editable install points
        # at whichever checkout bootstrapped last): a router without the busy-level counters would pass for
        # "independent nodes" and check the wrong model
        raise RuntimeError(f"the deployed router ({metrics_url}) does not export {RELEASES}: it runs an older tilepd than "
                           "this checkout; reinstall this checkout into the venv the services use")
    async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits) as client:
        for _ in range(args.warm_requests):  # first requests pay one-off costs (allocations, caches)
            rec = Sent(time.monotonic())
            await one(client, url, payload, rec)
            if rec.status != 200:
                raise RuntimeError(f"warm-up request failed: {rec.status} {rec.error}")
        cal = await calibrate(client, url, metrics_url, payload, args.nodes, 2 * args.nodes, args.calibrate_s)
        print(f"[capacity-check] calibration: {cal['completed']} requests in {cal['seconds']:.1f} s with {cal['workers']} "
              f"closed-loop clients ({cal['throughput_rps']:.2f} req/s): mean lease hold {fmt_ms(cal['mean_hold_s'])}, "
              f"capacity {args.nodes} nodes / hold = {cal['capacity_rps']:.2f} req/s", flush=True)
        levels = []
        for i, util in enumerate(args.levels):
            rate = util * cal["capacity_rps"]
            print(f"[capacity-check] level {util:g}: {rate:.2f} req/s for {args.level_s:g} s", flush=True)
            lv = await level(client, url, payload, topo, rate, args.level_s, args.warmup_s, args.seed + i,
                             args.queue_timeout_s, args.trace)
            lv["target_utilisation"] = util
            lv["verdict"] = verdict(lv, args.bound, args.queue_timeout_s)
            levels.append(lv)
            await asyncio.sleep(args.gap_s)  # the queue drains before the next level
    return {"calibration": cal, "levels": levels}


def report(result: dict[str, Any], bound: float) -> None:
    print()
    print(f"{'level':>5} {'offered':>9} {'util':>6} {'n(win)':>7} {'429':>6} {'p99 client':>11} {'p99 hist':>9} "
          f"{'p99 formula':>12} {'p99 sim':>8} {'f/meas':>7} {'s/meas':>7}  verdict")
    for lv in result["levels"]:
        v = lv["verdict"]
        w = lv["window"]
        print(f"{lv['target_utilisation']:>5g} {lv['offered_rps']:>5.2f} r/s {fmt(v['utilisation'], '.2f'):>6} "
              f"{w['served_with_wait']:>7} {fmt(w['busy_fraction'], '.2%'):>6} {fmt_ms(v['client_p99_wait_s']):>11} "
              f"{fmt_ms(v['router_hist_p99_wait_s']):>9} {fmt_ms(v['formula_p99_wait_s']):>12} {fmt_ms(v['simulation_p99_wait_s']):>8} "
              f"{fmt(v['formula_ratio'], '.2f'):>7} {fmt(v['simulation_ratio'], '.2f'):>7}  "
              f"{'PASS' if v['pass'] else 'FAIL'} (bound {bound:.0%}; model {v['model']})"
              f"{' saturated: p99 at the queue timeout' if v['saturated'] else ''}")
    for lv in result["levels"]:
        v = lv["verdict"]
        print(f"[capacity-check] level {lv['target_utilisation']:g}: service mean {fmt_ms(v['service_mean_s'])} CV "
              f"{fmt(v['service_cv'], '.2f')}; P(wait) measured {fmt(v['p_wait'], '.1%')} / formula "
              f"{fmt(v['formula_p_wait'], '.1%')} / sim {fmt(v['simulation_p_wait'], '.1%')}; busy measured "
              f"{fmt(v['busy_fraction'], '.2%')} / formula {fmt(v['formula_busy'], '.2%')} / sim {fmt(v['simulation_busy'], '.2%')}; "
              f"vs router histogram: formula {fmt(v['formula_vs_hist_ratio'], '.2f')}, sim {fmt(v['simulation_vs_hist_ratio'], '.2f')}; "
              f"FIFO replay of the measured arrivals and service times: p99 {fmt_ms(lv['replay_p99_wait_s'])}, "
              f"with the service times shuffled (i.i.d., the model's assumption): {fmt_ms(lv['shuffled_replay_p99_wait_s'])}; "
              f"service alone {fmt_ms(lv['service_by_company']['alone_mean_s'])} (n {lv['service_by_company']['alone_n']}) vs next "
              f"to another request {fmt_ms(lv['service_by_company']['shared_mean_s'])} (n {lv['service_by_company']['shared_n']})")
        levels = ", ".join(f"{b} busy: {fmt_ms(m)} (n {n:g})" for b, m, n in v["service_by_busy"])
        by_busy = v.get("measured_by_busy") or {}
        band = v.get("window_band")
        if band:
            print(f"[capacity-check]   one {lv['window_s']:g} s window's p99 if the model were exact (simulated, {band['windows']} "
                  f"windows): {band['p10']:.2f}-{band['p90']:.2f} of the long run (10-90%); within {bound:.0%}: "
                  f"{band['within_bound']:.0%} of windows")
        print(f"[capacity-check]   model: {v['model']}" + (f" ({levels}; work CV {fmt(v['work_cv'], '.2f')} from "
                                                            f"{v.get('work_cv_source') or '-'})" if levels else "")
              + "; router pool by busy level (mean service, seconds there, releases): "
              + (", ".join(f"{k}: {fmt_ms(x['mean_s'])}, {x['seconds']:.1f} s, n {x['releases']:g}" for k, x in sorted(by_busy.items())) or "-"))
        host = lv.get("host_cpu") or {}
        if host.get("steal_s") is not None:
            print(f"[capacity-check]   host: {host['steal_s']:.1f} s of CPU stolen by the hypervisor over the level "
                  "(per-second samples in the JSON, host_cpu)")
        if lv["errors"]:
            print(f"[capacity-check]   errors: {lv['errors']}")
        if lv["capacity"] is None:
            print(f"[capacity-check]   tilepd capacity failed: {lv['capacity_stderr']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", help="base dir of the deployment (default: a fresh temp dir)")
    ap.add_argument("--port-base", type=int, default=19000, help="router port; prefill +100, decode nodes +10..12, +20..22")
    ap.add_argument("--queue-timeout-s", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--decode-threads", type=int, default=1,
                    help="OMP_NUM_THREADS of each decode node (0: torch's default, every core). 1 by default: with every "
                         "core each, the two nodes' OpenMP teams and vLLM's oversubscribe a small box and the holds come "
                         "in slow stretches no queue model predicts (docs/CAPACITY.md, fifth run)")
    ap.add_argument("--levels", type=lambda s: [float(x) for x in s.split(",")], default=[0.4, 0.6],
                    help="offered utilisations, as fractions of the calibrated capacity")
    ap.add_argument("--level-s", type=float, default=420.0,
                    help="seconds of load per level (a window much shorter measures its p99 too loosely: see window_band)")
    ap.add_argument("--warmup-s", type=float, default=10.0, help="seconds of each level before the capacity window opens")
    ap.add_argument("--calibrate-s", type=float, default=20.0)
    ap.add_argument("--warm-requests", type=int, default=5)
    ap.add_argument("--gap-s", type=float, default=5.0)
    ap.add_argument("--request-timeout-s", type=float, default=60.0)
    ap.add_argument("--bound", type=float, default=0.25, help="largest |predicted/measured - 1| that passes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="store_true", help="keep every request (send time, status, wait, service) in the JSON")
    ap.add_argument("--keep", action="store_true", help="leave the stack running (default: tilepd down at the end)")
    ap.add_argument("--json", action="store_true", help="the whole result as JSON on stdout")
    ap.add_argument("--out", help="also write the JSON result to this file (e.g. bench/results/capacity_check.json)")
    args = ap.parse_args()
    args.nodes = 2
    base = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="tilepd-capacity-check-"))
    base.mkdir(parents=True, exist_ok=True)
    topo = base / "capacity-check.yaml"
    text = topology_yaml(base, args.port_base, args.queue_timeout_s, args.decode_threads)
    busy = [p for p in ports_of(args.port_base) if not port_free(p)]
    # busy ports are fine only when they are this workdir's own deployment, left up by an earlier --keep run
    if busy and not (topo.is_file() and topo.read_text() == text):
        print(f"[capacity-check] ports in use: {busy}; pick another --port-base")
        return 2
    topo.write_text(text)
    print(f"[capacity-check] topology {topo}; `tilepd up` (a first start builds the tiny model and starts vLLM)", flush=True)
    t_up = time.monotonic()
    result: dict[str, Any] = {"topology": str(topo), "args": {k: v for k, v in vars(args).items()},
                              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host_cpus": os.cpu_count()}
    try:
        up = tilepd("up", str(topo), "-y")
        if up.returncode != 0:
            print(up.stdout[-4000:], up.stderr[-4000:], sep="\n")
            print(f"[capacity-check] tilepd up failed (rc {up.returncode})")
            return 2
        print(f"[capacity-check] up in {time.monotonic() - t_up:.0f} s", flush=True)
        result.update(asyncio.run(drive(args, topo)))
    finally:
        if not args.keep:
            down = tilepd("down", str(topo), "-y")
            print(f"[capacity-check] tilepd down rc={down.returncode}", flush=True)
            if down.returncode != 0:
                print(down.stdout[-2000:], down.stderr[-2000:], sep="\n")
    report(result, args.bound)
    ok = all(lv["verdict"]["pass"] for lv in result["levels"])
    result["pass"] = ok
    text = json.dumps(finite(result), indent=2, default=lambda v: None, allow_nan=False)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    print(f"capacity-check: {'PASS' if ok else 'FAIL'}: {sum(lv['verdict']['pass'] for lv in result['levels'])}/"
          f"{len(result['levels'])} levels within {args.bound:.0%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
