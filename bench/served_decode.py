"""The decode node as served vs its engine alone: per-token speed at the HTTP client, host work per token,
and the time from KV arrival to the first decoded token, in one run.

The node is the real one (`tilepd.runtime.server`'s pieces: `start_engine` on an engine thread,
`DecodeService`, `warm_up`, the control server, `build_app` under uvicorn) over random Llama-3-8B-shaped
weights written to disk in tilepd's runtime format (rank0.safetensors + manifest.json) and loaded by
`load_engine`. A client process plays the prefill and the router: per request it opens the streamed
`/v1/decode`, waits until the node holds the slot, sends the KV through the control protocol with a
`KVSender` (tcp on this host), and timestamps every NDJSON token line as it arrives. Interleaved with
those requests, the same engine decodes the same KV (the bytes still in the receive buffer) on its own
thread, its token callback only noting the time: the engine's own ms/token in the same run, on the same
graphs. The node is authenticated as deployed (a deployment secret: bearer key + transfer tokens).

Figures per context (medians over --reps): served ms/token = time between the client's receipt of token
n/8 and of token n, per token; engine ms/token = the same window of the engine's own token times
(`engine_timings_ms_per_token`: from its decode timings, tokens 2..n); speed ratio = engine / served
(target >= 0.99 on the GPU); host work per token = CPU time of the node's event-loop thread (HTTP, token
stream, NDJSON, socket writes) and of the whole process while decoding, served vs alone; KV arrival ->
first token = client receipt of the first token line minus the end of the KV wire write (includes the
node's checksum verify, convert, inject and the first step, each given in the row).

    python bench/served_decode.py                        # H200: Llama-3-8B shapes, 1K/8K/32K context
    python bench/served_decode.py --json --out served.json
    python bench/served_decode.py --device cpu --tiny    # seconds on CPU (the test suite runs this)

Needs, beside torch: fastapi, uvicorn, httpx, prometheus_client, xxhash (and uvloop/httptools, which the
deployed node uses when present); a missing one is named before any weights are written.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import multiprocessing as mp
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tilepd (and tests) first

from kit import LLAMA3_8B, emit_report

REPO = Path(__file__).resolve().parents[1]
NEEDED = ("fastapi", "uvicorn", "httpx", "prometheus_client", "xxhash", "numpy")

TINY_LLAMA = {**LLAMA3_8B, "bos_token_id": 0, "eos_token_id": 1, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
FIRST_TOKEN = 3
BLOCK_SIZE = 16  # vLLM's default block size on the prefill side


def missing_packages() -> list[str]:
    """Modules the node, the client or the checksums need that do not import here (checked before any GPU work)."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        return missing
    for mod in ("tilepd.runtime.http_api", "tilepd.runtime.server", "tilepd.control.sender", "uvicorn.config", "httpx"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            missing.append(f"{e.name} (imported by {mod})")
    return missing


# -- weights on disk ---------------------------------------------------------------------------------------
def write_runtime_weights(cfg: dict[str, Any], out_dir: Path, device: torch.device, dtype: torch.dtype) -> tuple[Path, float]:
    """Random weights (tilepd.dev.synthetic.random_runtime_weights, built on `device`) written as tilepd's
    runtime format: rank0.safetensors in the layout's order + manifest.json (what load_engine reads).
    Returns (out_dir, GB written)."""
    from tilepd.dev.synthetic import random_runtime_weights
    from tilepd.model_format.model_spec import spec_from_hf_config
    from tilepd.weights.convert import rank_file
    from tilepd.weights.out_tensors import LAYOUT_VERSION, family_layout
    from tilepd.weights.manifest import CONVERTER_VERSION, FORMAT, write_manifest_atomically
    from tilepd.weights.safetensors_writer import StreamingSafetensorsWriter

    spec = spec_from_hf_config(cfg)
    weights = random_runtime_weights(spec, device, dtype)
    names = [t.name for t in family_layout(spec, set()) if t.name in weights]
    entries = [(n, weights[n].dtype, tuple(weights[n].shape)) for n in names]
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = StreamingSafetensorsWriter(out_dir / rank_file(0), entries, metadata={"format": "pt", "tilepd": FORMAT, "rank": "0", "tp": "1"})
    try:
        for n in names:
            writer.write(n, weights.pop(n))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    del weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dname = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]
    size = (out_dir / rank_file(0)).stat().st_size
    write_manifest_atomically(out_dir, {
        "format": FORMAT, "converter_version": CONVERTER_VERSION, "layout_version": LAYOUT_VERSION,
        "options": {"family": spec.family, "dtype": dname, "tp": 1}, "family": spec.family, "dtype": dname, "weight_format": dname,
        "tp": 1, "model_config": cfg, "generation_config": None, "spec": spec.to_dict(),
        "layout": {"tensors": {n: {"dtype": str(dt).removeprefix("torch."), "shape": list(s)} for n, dt, s in entries}},
        "sources": [], "synthetic": "random weights written by bench/served_decode.py",
        "files": [{"file": rank_file(0), "rank": 0, "size": size}],
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })
    return out_dir, size / 1e9


def pick_workdir(want_bytes: int) -> Path:
    """/dev/shm when it holds the weights with room to spare (no disk write-back in the timed run), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.5 * want_bytes:
        return Path(tempfile.mkdtemp(prefix="tilepd-served-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="tilepd-served-"))


# -- the node, in this process ------------------------------------------------------------------------------
class Node:
    """A decode node built as `tilepd.runtime.server.serve` builds it, with uvicorn on a thread of this process."""

    def __init__(self, weights_dir: Path, device: str, max_seq_len: int, secret: bytes | None) -> None:
        import uvicorn

        from tilepd.auth import transfer_token_ok

        from tilepd.contracts.service_configs import DecodeServerConfig, TransportConfig
        from tilepd.runtime.http_api import build_app
        from tilepd.runtime.server import engine_geometry, start_engine
        from tilepd.runtime.service import DecodeService

        self.config = DecodeServerConfig(name="served-bench", served_model_name="bench", family="llama", weights_dir=weights_dir,
                                         max_seq_len=max_seq_len, device=device, bind_host="127.0.0.1", advertise_host="127.0.0.1",
                                         http_port=0, ctrl_port=0, transport=TransportConfig(name="tcp"), kv_timeout_s=120)
        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        t0 = time.perf_counter()
        self.engine = worker.submit(start_engine, weights_dir, 1, device=device, max_seq_len=max_seq_len, dtype=None,
                                    use_cuda_graph=True if device == "cuda" else None, num_speculative_tokens=0).result()
        self.load_s = time.perf_counter() - t0
        self.svc = DecodeService(self.config, self.engine, engine_geometry(self.engine), worker=worker)
        if secret is not None:  # as deployed: the router's bearer key and a minted transfer token on every decode
            self.svc.ctrl.token_ok = lambda transfer_id, token: transfer_token_ok(secret, transfer_id, token)
        self.warm_s = self.svc.warm_up()
        self.svc.start()
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.svc, secret), host="127.0.0.1", port=0, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the node's HTTP server did not start")
            time.sleep(0.01)
        self.http_port = self.server.servers[0].sockets[0].getsockname()[1]
        self._loop_clock = time.pthread_getcpuclockid(self._thread.ident)  # type: ignore[arg-type]

    def loop_cpu_s(self) -> float:
        """CPU time the node's event-loop thread (HTTP, the token stream) has used so far."""
        return time.clock_gettime(self._loop_clock)

    @property
    def ctrl_port(self) -> int:
        return self.svc.ctrl.port

    def engine_alone(self, layout: Any, seq_len: int, tokens: int) -> dict[str, Any]:
        """The engine decoding the KV still in the receive buffer (the last served transfer's), on its own
        thread, its token callback only taking the time: convert + inject + decode, as run_decode does,
        minus serving."""
        from tilepd.engine.types import KVState, SamplingParams
        from tilepd.runtime.kv_convert import convert

        svc, cuda = self.svc, self.svc.device.type == "cuda"

        def run() -> dict[str, Any]:
            layers = convert(svc.recv_buf, layout, svc.config.max_seq_len, seq_len, svc.geometry.cache_dtype, svc.device)
            svc.engine.inject(KVState(seq_len=seq_len, layers=layers))
            if cuda:
                torch.cuda.synchronize()
            stamps: list[float] = []
            clock, keep = time.perf_counter, stamps.append
            c0 = time.process_time()
            res = svc.engine.decode(FIRST_TOKEN, tokens, SamplingParams(ignore_eos=True), lambda t: keep(clock()), None)
            cpu = time.process_time() - c0
            return {"tokens": list(res.tokens), "timings": dict(res.timings), "cpu_s": cpu, "stamps": stamps}

        return svc.worker.submit(run).result()

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.svc.close()


# -- the client process: prefill (KVSender) + router (HTTP stream reader) ----------------------------------------
def client_main(conn: Any, layout_json: str, max_seq_len: int, max_context: int, secret_hex: str | None) -> None:
    """Stage the KV (while the node loads), take ("node", http_url, ctrl_port), then serve ("run", transfer_id,
    seq_len, max_tokens) requests from `conn` until ("stop",)."""
    import httpx
    import numpy as np

    from tilepd.auth import node_auth_header, transfer_token
    from tilepd.control.cache_layout import CacheLayout
    from tilepd.control.sender import KVSender
    from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig
    from tilepd.transport import Buffer

    layout = CacheLayout.model_validate_json(layout_json)
    n_bytes = layout.num_layers * layout.blocks_for(max_context) * layout.block_bytes
    # random KV values (bf16/fp32, scale 0.5) tiled over the staging buffer: content does not change the timing
    wire = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[layout.dtype]
    pattern = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)) * 0.5).to(wire).view(torch.uint8).numpy()
    staging = np.resize(pattern, n_bytes)
    conn.send(("staged",))
    _, http_url, ctrl_port = conn.recv()
    cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="bench", host="127.0.0.1", ctrl_port=ctrl_port, http_port=1),),
                               transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=max_seq_len)
    sender = KVSender(cfg, layout, Buffer.from_array(staging))
    secret = bytes.fromhex(secret_hex) if secret_hex else None
    http = httpx.Client(base_url=http_url, timeout=600, headers=node_auth_header(secret))
    conn.send(("ready",))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, tid, seq_len, max_tokens = msg
            token = transfer_token(secret, tid) if secret else "bench"
            conn.send(_one_request(http, sender, layout, tid, token, seq_len, max_tokens, ctrl_port))
    finally:
        sender.close()
        http.close()


def _one_request(http: Any, sender: Any, layout: Any, tid: str, token: str, seq_len: int, max_tokens: int,
                 ctrl_port: int) -> dict[str, Any]:
    from tilepd.contracts.decode_http import NODE_API_VERSION, DecodeBody, ReserveBody

    held = http.post("/v1/reserve", json=ReserveBody(transfer_id=tid, token=token, holder="bench", node_api=NODE_API_VERSION).as_json())
    if held.status_code != 200:
        return {"error": f"/v1/reserve answered {held.status_code}: {held.text[:500]}"}
    body = DecodeBody(transfer_id=tid, token=token, fence=held.json()["fence"], first_token=FIRST_TOKEN, prompt_tokens=seq_len, max_tokens=max_tokens,
                      ignore_eos=True, stream=True).as_json()
    stamps: list[float] = []
    lines: list[dict] = []
    errors: list[str] = []

    def read_stream() -> None:
        try:
            with http.stream("POST", "/v1/decode", json=body) as r:
                if r.status_code != 200:
                    errors.append(f"/v1/decode answered {r.status_code}: {r.read().decode()[:500]}")
                    return
                for line in r.iter_lines():
                    if line:
                        stamps.append(time.perf_counter())
                        lines.append(json.loads(line))
        except Exception as e:  # noqa: BLE001 - reported in the row
            errors.append(f"{type(e).__name__}: {e}")

    reader = threading.Thread(target=read_stream)
    reader.start()
    deadline = time.monotonic() + 30
    while not http.get("/status").json()["decode_joined"]:  # the decode request joined its reservation: the KV may come
        if time.monotonic() > deadline or not reader.is_alive():
            reader.join(5)
            return {"error": "the decode request never reserved the slot: " + "; ".join(errors)}
        time.sleep(0.001)
    nb = layout.blocks_for(seq_len)
    res = sender.send(("127.0.0.1", ctrl_port), tid, token, seq_len, nb, [l * nb * layout.block_bytes for l in range(layout.num_layers)])
    t_acked = time.perf_counter()
    reader.join(600)
    if not res.ok:
        return {"error": f"KV send failed: {res.code}: {res.message}"}
    if errors or not lines or not lines[-1].get("done"):
        return {"error": "; ".join(errors) or f"stream ended without a done line ({len(lines)} lines)"}
    tokens = [x["token"] for x in lines[:-1]]
    t_tok = stamps[:-1]
    done_ms = res.timings.get("done_ms", 0.0)
    return {
        "tokens": tokens, "done": lines[-1], "sender": res.timings, "bytes": res.bytes,
        "kv_landed_to_first_token_ms": (t_tok[0] - (t_acked - done_ms / 1e3)) * 1e3,
        "kv_acked_to_first_token_ms": (t_tok[0] - t_acked) * 1e3,
        "stamps": t_tok,
    }


# -- the run --------------------------------------------------------------------------------------------------
def window_ms_per_token(stamps: list[float]) -> float:
    """ms/token between the arrival of token n/8 and of the last token: the steady decode, the same window for
    the client's stamps and the engine's (the first tokens also carry the stream's start-up)."""
    k = len(stamps) // 8
    return (stamps[-1] - stamps[k]) / (len(stamps) - 1 - k) * 1e3


def _steady_ms(timings: dict[str, float]) -> float:
    """The engine's own ms/token over tokens 2..n, from its timings (decode_ms less the first step)."""
    n = timings["tokens"]
    return (timings["decode_ms"] - timings["first_step_ms"]) / (n - 1) if n > 1 else timings["decode_ms"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = TINY_LLAMA if args.tiny else LLAMA3_8B
    max_seq_len = max(args.contexts) + args.tokens + 64
    from tilepd.model_format.model_spec import spec_from_hf_config

    spec = spec_from_hf_config(cfg)
    wire_dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"
    report: dict[str, Any] = {"model": "llama3-8b" + ("-tiny" if args.tiny else ""), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                              "torch": torch.__version__, "tokens": args.tokens, "reps": args.reps, "transport": "tcp", "rows": []}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    t_start = time.perf_counter()
    work = args.workdir or pick_workdir(int(2 * 8.1e9) if not args.tiny else 1 << 20)
    node = proc = None
    try:
        from tilepd.control.cache_layout import CacheLayout

        layout = CacheLayout(kind="attn", num_layers=spec.num_layers, block_size=BLOCK_SIZE, num_heads=spec.num_kv_heads,
                             entry_width=2 * spec.head_dim, dtype=wire_dtype, order="BHNC", head_size_k=spec.head_dim,
                             head_size_v=spec.head_dim)
        secret = None if args.no_secret else secrets.token_bytes(32)
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=client_main, args=(there, layout.model_dump_json(), max_seq_len, max(args.contexts),
                                                      secret.hex() if secret else None), daemon=True)
        proc.start()  # it stages the KV while the weights are written and loaded
        t0 = time.perf_counter()
        wdir, gb = write_runtime_weights(cfg, work / "weights", device, dtype)
        report["weights"] = {"dir": str(wdir), "GB": gb, "write_s": time.perf_counter() - t0}
        print(f"weights: {gb:.2f} GB written to {wdir} in {report['weights']['write_s']:.1f} s", file=sys.stderr, flush=True)
        node = Node(wdir, args.device, max_seq_len, secret)
        report["node"] = {"authenticated": secret is not None, "http_protocol": node.server.config.http_protocol_class.__name__,
                          "uvloop": importlib.util.find_spec("uvloop") is not None, "load_s": node.load_s, "warm_up_s": node.warm_s,
                          "speed_path": getattr(node.engine, "speed_path", None), "max_seq_len": max_seq_len}
        print(f"node: engine loaded in {node.load_s:.1f} s, warm-up {node.warm_s:.1f} s, speed path {report['node']['speed_path']}",
              file=sys.stderr, flush=True)
        if not here.poll(300) or here.recv()[0] != "staged":
            raise RuntimeError("the client process did not stage its KV within 300 s")
        here.send(("node", f"http://127.0.0.1:{node.http_port}", node.ctrl_port))
        if not here.poll(60) or here.recv()[0] != "ready":
            raise RuntimeError("the client process did not connect")
        for c in args.contexts:
            report["rows"].append(_context_row(node, here, layout, c, args))
            r = report["rows"][-1]
            print(f"  {c:>6}: served {r.get('served_ms_per_token', float('nan')):.3f} ms/token, engine {r.get('engine_ms_per_token', float('nan')):.3f}"
                  f" -> {r.get('speed_ratio', float('nan')):.4f}; KV->first token {r.get('kv_landed_to_first_token_ms', float('nan')):.1f} ms"
                  + (f"; ERROR {r['error']}" if r.get("error") else ""), file=sys.stderr, flush=True)
        here.send(("stop",))
        proc.join(30)
    finally:
        if proc is not None and proc.is_alive():
            proc.terminate()
            proc.join(10)
        if node is not None:
            node.close()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = time.perf_counter() - t_start
    return report


def _context_row(node: Node, conn: Any, layout: Any, context: int, args: argparse.Namespace) -> dict[str, Any]:
    """Served and engine-alone decodes of the same KV, interleaved: one warm-up pair, then --reps pairs."""
    served: list[dict] = []
    alone: list[dict] = []
    row: dict[str, Any] = {"context": context, "tokens": args.tokens}
    for rep in range(args.reps + 1):
        loop0 = node.loop_cpu_s()
        conn.send(("run", f"bench-{context}-{rep}", context, args.tokens))
        s = conn.recv()
        if "error" in s:
            row["error"] = s["error"]
            return row
        s["loop_cpu_s"] = node.loop_cpu_s() - loop0
        s["verify_ms"] = node.svc.ctrl.last_verify_ms
        e = node.engine_alone(layout, context, args.tokens)
        if rep:  # the first pair warms up (allocator, first use of this window's graph)
            served.append(s)
            alone.append(e)
    med = statistics.median
    n = args.tokens
    srv_ms = [window_ms_per_token(s["stamps"]) for s in served]
    eng_ms = [window_ms_per_token(e["stamps"]) for e in alone]
    gaps = [sorted(b - a for a, b in zip(s["stamps"], s["stamps"][1:])) for s in served]
    row.update({
        "served_ms_per_token": med(srv_ms), "engine_ms_per_token": med(eng_ms),
        "speed_ratio": med(eng_ms) / med(srv_ms),
        "speed_ratio_per_pair": [e / s for e, s in zip(eng_ms, srv_ms)],
        # the engine's own timings: alone, and inside the served decode (its loop with the HTTP token callback)
        "engine_timings_ms_per_token": med(_steady_ms(e["timings"]) for e in alone),
        "engine_in_served_ms_per_token": med(_steady_ms(s["done"]["timings"]) for s in served),
        "served_gap_p50_ms": med(g[len(g) // 2] * 1e3 for g in gaps),
        "served_gap_p99_ms": med(g[int(0.99 * (len(g) - 1))] * 1e3 for g in gaps),
        # host work: the event-loop thread's CPU per token (HTTP handling, the token stream, NDJSON, socket writes),
        # and the whole process's CPU per token while decoding, served vs alone
        "loop_cpu_us_per_token": med(s["loop_cpu_s"] * 1e6 / n for s in served),
        "host_cpu_us_per_token_served": med(s["done"]["timings"]["decode_cpu_ms"] * 1e3 / n for s in served),
        "host_cpu_us_per_token_engine": med(e["cpu_s"] * 1e6 / n for e in alone),
        "kv_landed_to_first_token_ms": med(s["kv_landed_to_first_token_ms"] for s in served),
        "kv_acked_to_first_token_ms": med(s["kv_acked_to_first_token_ms"] for s in served),
        "kv_bytes": served[0]["bytes"],
        "kv_wire_ms": med(s["sender"].get("wire_ms", float("nan")) for s in served),
        "node_verify_ms": med(s["verify_ms"] for s in served),
        "node_convert_ms": med(s["done"]["timings"]["convert_ms"] for s in served),
        "node_inject_ms": med(s["done"]["timings"]["inject_ms"] for s in served),
        "node_first_step_ms": med(s["done"]["timings"]["first_step_ms"] for s in served),
        "tokens_match": all(s["tokens"] == e["tokens"] for s, e in zip(served, alone)),
        "served_tokens": len(served[0]["tokens"]),
    })
    row["host_cpu_us_per_token_added"] = row["host_cpu_us_per_token_served"] - row["host_cpu_us_per_token_engine"]
    return row


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"served vs engine: {report['model']} on {report.get('gpu', report['device'])} ({report['dtype']}), "
                    f"{report['tokens']} tokens, median of {report['reps']}")
    cols = ("context", "served ms/tok", "engine ms/tok", "served/engine speed", "loop CPU us/tok", "KV->1st tok ms",
            "verify/convert/inject/step1 ms", "tokens match")
    for c in cols:
        t.add_column(c)
    for r in report["rows"]:
        if r.get("error"):
            t.add_row(str(r["context"]), "-", "-", "-", "-", "-", r["error"][:60], "-")
            continue
        t.add_row(str(r["context"]), f"{r['served_ms_per_token']:.3f}", f"{r['engine_ms_per_token']:.3f}", f"{r['speed_ratio']:.2%}",
                  f"{r['loop_cpu_us_per_token']:.0f}", f"{r['kv_landed_to_first_token_ms']:.1f}",
                  f"{r['node_verify_ms']:.1f}/{r['node_convert_ms']:.1f}/{r['node_inject_ms']:.1f}/{r['node_first_step_ms']:.2f}",
                  str(r["tokens_match"]))
    Console(width=160).print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny Llama shapes (CPU smoke test, seconds)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="prompt lengths (default 1024 8192 32768; tiny: 64 256)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per decode (default 256; tiny: 64)")
    ap.add_argument("--reps", type=int, default=3, help="timed served/engine pairs per context, after one warm-up pair")
    ap.add_argument("--no-secret", action="store_true", help="serve without a deployment secret (default: authenticated, as deployed)")
    ap.add_argument("--workdir", type=Path, default=None, help="write the weights here and keep them (default: a temp dir, removed)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)
    missing = missing_packages()
    if missing:
        sys.exit(f"bench/served_decode.py cannot import: {', '.join(missing)}")
    if args.reps < 1:
        sys.exit("--reps must be at least 1")
    args.contexts = args.contexts or ([64, 256] if args.tiny else [1024, 8192, 32768])
    args.tokens = args.tokens or (64 if args.tiny else 256)
    if args.tokens < 2:
        sys.exit("--tokens must be at least 2 (ms/token is timed between tokens)")
    logging.basicConfig(level=logging.WARNING)
    report = run(args)
    emit_report(report, args, _print)
    return 0 if not any(r.get("error") for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
