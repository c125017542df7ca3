"""Tensor-parallel batch-1 decode: tokens/s and % of the aggregate HBM read floor for N = 1, 2, 4, 8 ranks.

On one host with N GPUs (the target: 8x H200 or 8x B200), random bf16 weights built on each GPU (no disk):

    python bench/tp_decode.py --model llama70b --tp 2 4 8                 # Llama-3-70B shapes (80 layers)
    python bench/tp_decode.py --model llama70b --layers 20 --tp 1 2 4 8   # same layer shapes, 20 layers: fits 1 GPU
    python bench/tp_decode.py --model dsv3 --layers 4 --tp 1 2 4 8        # DeepSeek-V3 shapes (3 dense + MoE layers)
    python bench/tp_decode.py --model dsv3 --layers 40 --tp 8             # as deep as bf16 fits 8x141 GB
    python bench/tp_decode.py ... --json                                  # machine-readable

Each N runs as N processes (one per GPU, `torch.multiprocessing` spawn), NCCL all-reduce (NCCL_NVLS_ENABLE=0),
in lockstep exactly as the decode server runs them (tilepd.engine.tp). Figures per N: ms/token, tokens/s,
the floor per token = (the busiest rank's weight bytes read per step + its KV bytes at that context) / the
per-GPU read bandwidth measured on GPU 0 (so N ranks read at N times one GPU's bandwidth), and % of that
floor. The rows are measured side by side in one run. `--device cpu --model tiny-llama|tiny-dsv3` runs the same
code with gloo on tiny shapes (the test suite does, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import DSV3_SMALL, LLAMA3_8B, TINY_DSV3, TINY_LLAMA, read_bandwidth, step_read_bytes

LLAMA70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 128}
DSV3 = {**DSV3_SMALL, "num_hidden_layers": 61, "num_nextn_predict_layers": 0, "first_k_dense_replace": 3}
MODELS = {"llama70b": LLAMA70B, "dsv3": DSV3, "tiny-llama": TINY_LLAMA,
          "tiny-dsv3": {**TINY_DSV3, "num_nextn_predict_layers": 0, "num_attention_heads": 4, "num_key_value_heads": 4}}


def model_config(name: str, layers: int | None) -> dict:
    cfg = dict(MODELS[name])
    if layers:
        cfg["num_hidden_layers"] = layers
        cfg["first_k_dense_replace"] = min(cfg.get("first_k_dense_replace", 0), max(layers - 1, 0))
    return cfg


def rank_main(rank: int, size: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    """One rank: random shard, TP model, warm-up decode, timed decode; rank 0 writes the gathered figures."""
    from tilepd.dev.synthetic import random_runtime_weights
    from tilepd.engine.engine import engine_for
    from tilepd.model_format.model_spec import spec_from_hf_config
    from tilepd.engine.tp import TPGroup, build_tp_model
    from tilepd.engine.types import KVState, SamplingParams

    cuda = args.device == "cuda"
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    t_start = time.perf_counter()

    def phase(what: str) -> None:  # rank 0 narrates, so a run cut off by a time limit shows where it was
        if rank == 0:
            print(f"  [tp={size} rank 0 {time.perf_counter() - t_start:6.1f}s] {what}", file=sys.stderr, flush=True)

    if cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    engine = None
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        spec = spec_from_hf_config(model_config(args.model, args.layers)).with_cache_dtype(str(dtype).removeprefix("torch."))
        phase("process group up")
        weights = random_runtime_weights(spec, dev, dtype, rank=rank, tp=size)
        phase(f"random weights built ({sum(w.numel() * w.element_size() for w in weights.values()) / 1e9:.1f} GB on this rank)")
        tp = TPGroup(rank, size, dist.group.WORLD, dist.group.WORLD)
        tp.all_reduce(torch.zeros(1, device=dev))  # NCCL communicator up before any graph capture
        max_seq = args.context + 2 * args.tokens + 8
        model = build_tp_model(spec, weights, max_seq, dev, dtype, tp)
        graphs = cuda and not args.no_graph
        # what the decode server runs (load_rank_engine): the speed path unless --plain-graph
        engine = engine_for(model, spec, dev, max_seq, use_cuda_graph=graphs, num_speculative_tokens=0,
                            speed_path=not args.plain_graph)
        path = engine.speed_path
        phase(f"model built, path {path}")
        weight_bytes, kv_bytes = step_read_bytes(model.spec, weights, args.context)
        gen = torch.Generator(device=dev).manual_seed(1)
        shape = (args.context, *model.caches[0].shape[1:])
        state = KVState(args.context, [torch.randn(*shape, generator=gen, device=dev, dtype=dtype) * 0.5 for _ in model.caches])
        greedy = SamplingParams(ignore_eos=True)
        bw = read_bandwidth(dev, args.bw_gib)["sum_read_GBps"] if rank == 0 else 0.0
        phase(f"bandwidth probe {bw:.0f} GB/s")
        engine.warmup(max_windows=1)
        phase("graphs captured" if graphs else "warmed up")
        engine.inject(state)
        engine.decode(0, min(args.tokens, 8), greedy, lambda t: None)
        engine.inject(state)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        res = engine.decode(0, args.tokens, greedy, lambda t: None)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        phase(f"timed decode: {args.tokens} tokens in {elapsed:.3f} s")
        if graphs and engine.graph_step is not None and engine.graph_step.capture_error:
            path += f" (capture fell back: {engine.graph_step.capture_error[:120]})"
        every: list = [None] * size
        dist.all_gather_object(every, {"s": elapsed, "n": len(res.tokens), "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
                                       "tokens": res.tokens[:8], "path": path})
        if rank == 0:
            Path(out).write_text(json.dumps({"bw_GBps": bw, "ranks": every}))
    finally:
        # as the decode server leaves: graphs dropped first, destroy_process_group bounded (it hung on
        # 2x H200 after graph decodes, both ranks inside it)
        from tilepd.engine.tp_engine import leave_group

        leave_group(engine, timeout_s=5.0)


def run_n(args: argparse.Namespace, size: int) -> dict:
    """Spawn `size` ranks and return their figures (or the error that stopped them)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        try:
            mp.start_processes(rank_main, args=(size, init_file, args, out), nprocs=size, start_method="spawn")
            data = json.loads(Path(out).read_text())
        except Exception as exc:  # noqa: BLE001 - one N failing (out of memory) must not hide the others
            return {"tp": size, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:400]}
    ranks = data["ranks"]
    n = ranks[0]["n"]
    slowest = max(r["s"] for r in ranks)
    busiest = max(r["weight_bytes"] + r["kv_bytes"] for r in ranks)
    floor_s = busiest / (data["bw_GBps"] * 1e9)
    ms = slowest / n * 1e3
    return {"tp": size, "tokens": n, "ms_per_token": ms, "tokens_per_s": 1e3 / ms,
            "floor_ms_per_token": floor_s * 1e3, "floor_tokens_per_s": 1 / floor_s, "pct_of_floor": 100 * floor_s * 1e3 / ms,
            "path": ranks[0]["path"], "gpu_read_GBps": data["bw_GBps"], "aggregate_read_GBps": data["bw_GBps"] * size,
            "step_read_GB_total": sum(r["weight_bytes"] + r["kv_bytes"] for r in ranks) / 1e9,
            "same_tokens_on_all_ranks": all(r["tokens"] == ranks[0]["tokens"] for r in ranks)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama70b")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (same per-layer shapes)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="rank counts to run, one after another")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--context", type=int, default=1024, help="tokens already in the cache")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded in the timed run")
    ap.add_argument("--bw-gib", type=float, default=4.0, help="size of the bandwidth probe on GPU 0")
    ap.add_argument("--no-graph", action="store_true", help="eager steps (no CUDA graph)")
    ap.add_argument("--plain-graph", action="store_true",
                    help="CUDA graph of the plain step (no Triton attention / torch.compile speed path)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        have = torch.cuda.device_count()
        if max(args.tp) > have:
            print(f"skipping tp > {have}: this host has {have} GPU(s)", file=sys.stderr)
            args.tp = [n for n in args.tp if n <= have]
    else:
        args.bw_gib = min(args.bw_gib, 0.25)
    rows = []
    for n in args.tp:
        try:
            rows.append(run_n(args, n))
        except Exception:  # noqa: BLE001
            rows.append({"tp": n, "error": traceback.format_exc(limit=2)[-400:]})
    report = {"model": args.model, "config": model_config(args.model, args.layers), "device": args.device, "context": args.context, "rows": rows}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.model} ({report['config']['num_hidden_layers']} layers), context {args.context}, {args.device}")
        print(f"{'tp':>3} {'ms/token':>9} {'tokens/s':>9} {'floor tok/s':>11} {'% floor':>8} {'aggr GB/s':>10}")
        for r in rows:
            if "error" in r:
                print(f"{r['tp']:>3} error: {r['error']}")
            else:
                print(f"{r['tp']:>3} {r['ms_per_token']:9.2f} {r['tokens_per_s']:9.1f} {r['floor_tokens_per_s']:11.1f} "
                      f"{r['pct_of_floor']:7.1f}% {r['aggregate_read_GBps']:10.1f}  {r['path']}")
    return report


if __name__ == "__main__":
    main()
