"""Tensor-parallel inject: one receive buffer on rank 0 plus device copies, against per-rank receive buffers.

What the decode server does today (`TPEngine.inject`): the whole prefix arrives in one host buffer on
rank 0; per layer rank 0 copies it to its GPU and `dist.scatter`s each rank's KV heads over NCCL.
The alternative the design leaves open: each rank owns a host receive buffer holding only its heads
(the sender would write N regions) and copies it to its own GPU, with no NCCL in the path. Both are
timed side by side in one run, for a llama-70B-shaped state (80 layers, 8 KV heads x 128, K|V) at
several context lengths; the ratio is per-rank / one-buffer time.

    python bench/tp_inject.py --tp 2 --context 1024 8192 32768        # on a host with >= 2 GPUs
    python bench/tp_inject.py --device cpu --tp 2 --layers 2 --context 256   # gloo, tiny (the test suite runs this)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilepd.engine.tp_engine import leave_group


def rank_main(rank: int, size: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    cuda = args.device == "cuda"
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, width = args.kv_heads, 2 * args.head_dim
    hh = heads // size  # this rank's KV heads
    pin = cuda and not args.pageable
    rows: list[dict] = []

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    try:
        for ctx in args.context:
            cache = [torch.empty(ctx, hh, width, dtype=dtype, device=dev) for _ in range(args.layers)]
            base = (torch.arange(ctx * heads * width) % 251).to(torch.int16).view(ctx, heads, width)

            def layer_values(layer: int) -> torch.Tensor:  # exact in bf16, different per layer and position
                return ((base + layer) % 251).to(dtype)

            # rank 0's one buffer: the whole state (all heads) in host memory, as received
            whole = [layer_values(l) for l in range(args.layers)] if rank == 0 else []
            # per-rank buffers: only this rank's heads, contiguous, in host memory the rank owns
            own = [layer_values(l)[:, rank * hh:(rank + 1) * hh].contiguous() for l in range(args.layers)]
            if pin:
                whole, own = [t.pin_memory() for t in whole], [t.pin_memory() for t in own]
            times = {"one_buffer_scatter": float("inf"), "per_rank_buffers": float("inf")}
            for rep in range(args.reps + 1):  # the first round warms up (NCCL channels, allocator)
                for variant in times:
                    sync()
                    t0 = time.perf_counter()
                    for layer in range(args.layers):
                        if variant == "one_buffer_scatter":  # TPEngine.inject / _recv_state
                            if rank == 0:
                                x = whole[layer].to(dev)
                                dist.scatter(cache[layer], [p.contiguous() for p in x.chunk(size, dim=1)], src=0)
                            else:
                                dist.scatter(cache[layer], None, src=0)
                        else:
                            cache[layer].copy_(own[layer], non_blocking=True)
                    sync()
                    if rep:
                        times[variant] = min(times[variant], time.perf_counter() - t0)
                    for layer in (0, args.layers - 1):  # each rank holds exactly its heads
                        if not torch.equal(cache[layer].cpu(), own[layer]):
                            raise AssertionError(f"{variant}: rank {rank} layer {layer} holds the wrong heads")
                        cache[layer].zero_()
            state_bytes = args.layers * ctx * heads * width * cache[0].element_size()
            rows.append({"context": ctx, "state_GB": state_bytes / 1e9, **{f"{k}_ms": v * 1e3 for k, v in times.items()}})
            del cache, whole, own
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        leave_group(None, timeout_s=5.0)  # bounded: NCCL's destroy_process_group hung on 2x H200


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per variant after one warm-up (the best is kept)")
    ap.add_argument("--pageable", action="store_true", help="host buffers in pageable instead of pinned memory")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.reps < 1:
        sys.exit("--reps must be at least 1")
    if args.kv_heads % args.tp:
        sys.exit(f"--kv-heads {args.kv_heads} does not split over --tp {args.tp}")
    if args.device == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        mp.start_processes(rank_main, args=(args.tp, init_file, args, out), nprocs=args.tp, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    for r in rows:
        r["ratio_per_rank_over_one_buffer"] = r["per_rank_buffers_ms"] / r["one_buffer_scatter_ms"]
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"inject, tp {args.tp}, {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} (K|V), {args.device}, "
              f"{'pinned' if args.device == 'cuda' and not args.pageable else 'pageable'} host buffers; best of {args.reps}")
        print(f"{'context':>8} {'state GB':>9} {'one buffer+scatter ms':>22} {'per-rank buffers ms':>20} {'ratio':>6}")
        for r in rows:
            print(f"{r['context']:>8} {r['state_GB']:9.2f} {r['one_buffer_scatter_ms']:22.1f} {r['per_rank_buffers_ms']:20.1f} "
                  f"{r['ratio_per_rank_over_one_buffer']:6.2f}")
    return rows


if __name__ == "__main__":
    main()
