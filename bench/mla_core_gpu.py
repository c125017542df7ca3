"""The persistent MLA attention core (mla_core_triton) against its three launches, and its grid barrier against a
kernel boundary, on this GPU (CUDA graphs, side by side in one process).

1. barrier: one launch of P programs crossing N grid barriers (grid_sync.barrier) against a chain of N dependent
   one-wave launches of P programs (the boundary the barrier replaces), with and without PDL's late trigger:
   us per barrier / per boundary;
2. the core: GLM-5.1's shapes in bf16, T = 1, at 1K (prepare in the core, the split over the window's span) and
   2048 selected of a 32K window (prepare apart, as past index_topk), each call as the step makes it (kit.graph_time_us:
   20 calls in one graph, best of 5 replays), the three launches (prepare, split, merge_uv) against the core's one,
   with the core's outputs checked against the three's first.

    python bench/mla_core_gpu.py --out bench/results/mla-core-gpu_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import graph_time_us
from tilepd.engine import grid_sync, pdl
from tilepd.engine.grid_sync import barrier
from tilepd.engine.pdl import trigger, wait


@triton.jit
def _barriers(BAR, X, N, PDL: tl.constexpr):
    wait(PDL)
    for _ in range(N):
        barrier(BAR, tl.num_programs(0))
    tl.store(X + tl.program_id(0), 1.0)
    trigger(PDL)


@triton.jit
def _boundary(X, Y, PDL: tl.constexpr):
    wait(PDL)
    tl.store(Y + tl.program_id(0), tl.load(X + tl.program_id(0)) + 1.0)
    trigger(PDL)


def barrier_rows(n: int, dev: torch.device) -> list[dict]:
    rows = []
    for programs in (41, 130):
        for warps in (4, 8):
            x = torch.zeros(programs, device=dev)
            bar = grid_sync.counter(dev, f"bench barrier/{programs}", torch.int64)
            one = graph_time_us(lambda: _barriers[(programs,)](bar, x, n, PDL=0, num_warps=warps), dev, reps=5)
            bufs = [torch.zeros(programs, device=dev), torch.zeros(programs, device=dev)]

            def chain(flag: int) -> None:
                for i in range(n):
                    _boundary[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], PDL=flag, num_warps=warps, **({"launch_pdl": True} if flag else {}))
            plain = graph_time_us(lambda: chain(0), dev, reps=5)
            late = graph_time_us(lambda: chain(3), dev, reps=5)
            rows.append({"programs": programs, "warps": warps, "barriers": n, "us_per_barrier": one / n, "us_per_launch": plain / n,
                         "us_per_launch_pdl_late": late / n})
            print(f"P={programs:3d} warps={warps}: barrier {one / n:.2f} us, launch {plain / n:.2f} us, launch+PDL late {late / n:.2f} us",
                  flush=True)
    return rows


def core_rows(dev: torch.device) -> list[dict]:
    from tilepd.engine import mla_attention as A, mla_core_triton as K, mla_fused_triton as M

    bf, g = torch.bfloat16, torch.Generator().manual_seed(0)
    heads, nope, rank, rope, v = 64, 192, 512, 64, 256
    rows = []
    for form, slots in (("1K", 1296), ("2048-of-32K", 33040)):
        r = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dev, bf)  # noqa: E731
        cs, cache, w_uv, q, kv, w_uk, kvn = (r(1, 2, rope), r(slots, 1, rank + rope), r(heads, v, rank, s=0.05), r(1, heads * (nope + rope)),
                                             r(1, rank + rope), r(heads, nope, rank, s=0.05), r(rank, s=0.1) + 1)
        pos = torch.tensor([1023], device=dev)
        args = (q, kv, w_uk, kvn, 1e-6, cs, pos, cache, rank, rope, True)
        if form == "1K":
            span = {"length": slots, "lo": torch.zeros(1, dtype=torch.int64, device=dev), "hi": pos}
        else:
            span = {"length": 2048, "idx": torch.randperm(slots, generator=g)[:2048].view(1, -1).to(dev), "ok": torch.ones(1, 2048, dtype=torch.bool, device=dev)}
        tune = A.TUNE_SPARSE

        def three() -> torch.Tensor:
            qc, _ = M.prepare(*args)
            part, lse = A.split_partials(qc, cache, rank, 0.07, tune=tune, **span)
            return M.merge_uv(part, lse, w_uv, bf, bf)

        def core() -> torch.Tensor:
            if form == "1K":
                prep = M.prepare_plan(*args, block_c=K.TUNE["block_c"], unroll=bool(K.TUNE["prep_unroll"]))
                qc = prep.outputs[0]
            else:
                prep, (qc, _) = None, M.prepare(*args)
            return K.attention_core(prep, A.split_plan(qc, cache, rank, 0.07, tune=tune, **span), w_uv, bf, bf)

        want, got = three(), core()
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        t_three, t_core = graph_time_us(three, dev), graph_time_us(core, dev)
        rows.append({"form": form, "three_launches_us": t_three, "core_us": t_core, "core_over_three": t_core / t_three, "max_rel_err": err})
        print(f"{form}: three launches {t_three:.1f} us, core {t_core:.1f} us ({t_core / t_three:.2f}x; the core's prepare "
              f"{'inside' if form == '1K' else 'apart'}), max rel err {err:.1e}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--barriers", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dev = torch.device("cuda")
    pdl.SWITCH["on"] = 1
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "barrier": barrier_rows(a.barriers, dev), "core": core_rows(dev)}
    if a.out:
        a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
