"""The MLA attention core (prepare, split-KV attention, merge + W_UV) as one persistent launch (DeepSeek-V3 / GLM-5).

Why: between G2 and wo the fused half-layer ran three launches (mla_fused_triton.prepare, mla_attention's split kernel,
mla_fused_triton.merge_uv) that read ~30 MB of weights a layer but are latency-bound: on an H200 at 1K they took
9.1 + 8.0 + 8.6 us a layer plus the gaps between them, against ~7 us of bytes (docs/PERFORMANCE.md). Here one launch of
at most one program an SM (all resident: grid_sync) runs the three as phases, the programs meeting at a grid barrier
(grid_sync.barrier) where a kernel boundary was, and each program's W_UV tile is loaded before the last barrier (no
kernel of the step writes weights), so the merge phase reads only the partials. The phases are the three kernels' own
items (mla_fused_triton._prepare_item, mla_attention._split_item, mla_fused_triton._merge_uv_item / _merge_uv_loaded),
so the arithmetic and its rounding are theirs. Past DSA's index_topk the indexer needs prepare's outputs before the
attention, so there the core runs split and merge only (prepare stays a launch, then the indexer's).

Measured (one H100, 2026-12-07, docs/PERFORMANCE.md "The MLA attention core as one persistent launch"): alone, in a
CUDA graph, the core takes 0.89x the three launches' time at 1K and 0.81x past index_topk, but inside the step it is
slower: GLM-5.1 fp8 78L 17.61 against 17.01 ms/token at 1K, 20.28 against 19.84 at 32K, one TP8 rank's shard 6.67
against 5.25 ms a step; a grid barrier (~1.1 us) costs about what a kernel boundary with PDL's late trigger does
(0.8-1.0 us). So it stays off. Switch: TUNE["on"] (TILEPD_MLA_CORE). Under TRITON_INTERPRET=1 each phase is a launch of
its own (the barrier compiled out: grid_sync's docstring), which is how the CPU tests check the phases; the barrier runs
only on a GPU.
"""

from __future__ import annotations

import os

import torch

from tilepd.engine import grid_sync, pdl
from tilepd.engine.mla_attention import SplitPlan
from tilepd.engine.mla_fused_triton import Plan, merge_plan
from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
    from tilepd.engine.grid_sync import barrier
    from tilepd.engine.mla_attention import _split_item
    from tilepd.engine.mla_fused_triton import _merge_uv_item, _merge_uv_loaded, _prepare_item, _uv_weights
    from tilepd.engine.pdl import trigger, wait
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

# on: the switch (off: slower inside the step, the docstring). num_warps: the one launch's warps (the
# separate kernels ran 4 / 4 / 8). block_c: latent columns an absorb item (256: 2 items a head, so a 64-head prepare is
# ~one item a program). prep_unroll: the absorb's NOPE loop unrolled (all of an item's W_UK tile in flight).
# block_v: W_UV output channels a merge item. preload: each program's W_UV tile loaded before the last barrier
# (where the merge has at most one item a program).
TUNE: dict[str, int] = {
    "on": env_int("TILEPD_MLA_CORE", 0),
    "num_warps": env_int("TILEPD_MLA_CORE_WARPS", 8),
    "block_c": env_int("TILEPD_MLA_CORE_BLOCK_C", 256),
    "prep_unroll": env_int("TILEPD_MLA_CORE_PREP_UNROLL", 1),
    "block_v": env_int("TILEPD_MLA_CORE_BLOCK_V", 128),
    "preload": env_int("TILEPD_MLA_CORE_PRELOAD", 1),
}
PHASE_PREPARE, PHASE_SPLIT, PHASE_MERGE = 1, 2, 4


def available() -> bool:
    return triton is not None


def enabled(x: torch.Tensor) -> bool:
    """The core for a step whose activations are x: switch on, Triton here, a CUDA tensor or the interpreter."""
    return bool(TUNE["on"]) and available() and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _core_kernel(Q, KV, KX, WUK, KVN, KN, KB, CS, ICS, POS, C, IC, QOUT, X, XN, WP, WOUT, eps, x_eps,
                     s_qt, s_kvt, s_kxt, s_ct, s_c1, s_ict, s_ic1, s_cl, s_icl, s_ot, s_oh, s_xt, s_wp, s_wt,
                     QW, N_ABSORB, HIDDEN, N_PREP, T,
                     SQ, SC, IDX, OK, LO, HI, PART, LSE, H, L, CHUNK, qk_scale,
                     s_sqt, s_sqh, s_scl, s_it, s_pt, s_ph, s_ps, s_lt, s_lh, GROUPS, SPLITS,
                     WUV, OUT, V, s_out, N_VB, BAR,
                     NOPE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, IDX_D: tl.constexpr, INTERLEAVED: tl.constexpr,
                     IDX_INTERLEAVED: tl.constexpr, HAS_INDEX: tl.constexpr, HAS_WEIGHTS: tl.constexpr, ACT: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                     LAT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK_C: tl.constexpr, M_STAGES: tl.constexpr,
                     M_UNROLL: tl.constexpr, PHASES: tl.constexpr, SYNC: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr = False):
        pid = tl.program_id(0)
        n_programs = tl.num_programs(0)
        wait(PDL)
        if PHASES & 1:  # prepare: item (token t, its program p) as mla_fused_triton's prepare kernel runs it
            for item in range(pid, T * N_PREP, n_programs):
                _prepare_item(item % N_PREP, item // N_PREP, Q, KV, KX, WUK, KVN, KN, KB, CS, ICS, POS, C, IC, QOUT, X, XN, WP, WOUT,
                              eps, x_eps, s_qt, s_kvt, s_kxt, s_ct, s_c1, s_ict, s_ic1, s_cl, s_icl, s_ot, s_oh, s_xt, s_wp, s_wt,
                              QW, N_ABSORB, HIDDEN, NOPE, RANK, ROPE, IDX_D, INTERLEAVED, IDX_INTERLEAVED, HAS_INDEX, HAS_WEIGHTS,
                              ACT, BLOCK_C, BLOCK_D, BLOCK_K, STAGES, UNROLL)
            if SYNC:  # the query rows and the token's cache row, before any program attends over them
                barrier(BAR, n_programs)
        if PHASES & 2:  # the split-KV attention: item (head group, chunk) as mla_attention's split kernel runs it
            for item in range(pid, GROUPS * SPLITS, n_programs):
                _split_item(item % GROUPS, item // GROUPS, SQ, SC, IDX, OK, LO, HI, PART, LSE, H, L, CHUNK, qk_scale,
                            s_sqt, s_sqh, s_scl, s_it, s_pt, s_ph, s_ps, s_lt, s_lh, RANK, ROPE, BLOCK_H, BLOCK_N, SPARSE, PRECISION, UPCAST)
        if PHASES & 4:  # merge + W_UV: item (head row, output tile) as merge_uv's kernel runs it
            if PRELOAD:  # at most one item a program: its W_UV tile in flight across the barrier
                w = _uv_weights(WUV, pid // N_VB, pid % N_VB, H, V, RANK, BLOCK_V)
                if SYNC:
                    barrier(BAR, n_programs)
                if pid < T * H * N_VB:
                    _merge_uv_loaded(pid // N_VB, pid % N_VB, w, PART, LSE, OUT, SPLITS, H, V, s_pt, s_ph, s_ps, s_lt, s_lh, s_out,
                                     RANK, ACT, LAT, BLOCK_S, BLOCK_V)
            else:
                if SYNC:
                    barrier(BAR, n_programs)
                for item in range(pid, T * H * N_VB, n_programs):
                    _merge_uv_item(item // N_VB, item % N_VB, PART, LSE, WUV, OUT, SPLITS, H, V, s_pt, s_ph, s_ps, s_lt, s_lh, s_out,
                                   RANK, ACT, LAT, BLOCK_S, BLOCK_V, CHUNK_C, M_STAGES, M_UNROLL)
        trigger(PDL)  # pdl.py: the late form triggers here


def _no_prepare(split: SplitPlan) -> tuple[tuple, dict]:
    """Arguments in prepare's places when the core runs without its prepare phase (compiled out: never read)."""
    dummy = split.part
    constexprs = {"NOPE": 16, "IDX_D": 16, "INTERLEAVED": False, "IDX_INTERLEAVED": False, "HAS_INDEX": False, "HAS_WEIGHTS": False,
                  "BLOCK_C": 16, "BLOCK_D": 16, "BLOCK_K": 16, "STAGES": 1, "UNROLL": False}
    return (dummy,) * 17 + (0.0, 0.0) + (0,) * 14 + (0, 0, 1), constexprs


def attention_core(prep: Plan | None, split: SplitPlan, w_uv: torch.Tensor, act: torch.dtype, lat: torch.dtype, *,
                   one_launch: bool | None = None, programs: int | None = None) -> torch.Tensor:
    """prep (mla_fused_triton.prepare_plan, or None where prepare ran as its own launch) then split (mla_attention.
    split_plan over prep's query), merged and times W_UV [H, v, rank]: [T, H * v] in `act`, as merge_uv returns it.
    one_launch: the phases in one launch with the barrier (default: on a CUDA device, not under the interpreter);
    programs: that launch's grid at most (default: the device's SMs), for the sm_90 build checks on a CPU box."""
    if triton is None:
        raise RuntimeError("MLA core kernel needs Triton, which is not importable here")
    merge = merge_plan(split.part, split.lse, w_uv, act, lat, block_v=TUNE["block_v"])
    t, h = split.part.shape[:2]
    rank = split.constexprs["RANK"]
    if prep is not None:
        if prep.constexprs["RANK"] != rank or prep.constexprs["ACT"] != merge.constexprs["ACT"] or prep.outputs[0].data_ptr() != split.q.data_ptr():
            raise ValueError("MLA core: the split's query must be prepare's output, at the same rank and activation dtype")
        prep_args, prep_constexprs = prep.args, prep.constexprs
        n_prep = prep.grid[0]
    else:
        prep_args, prep_constexprs = _no_prepare(split)
        n_prep = 0
    q, rows, idx, ok, lo, hi, part, lse, heads, length, chunk, qk_scale, *split_strides = split.args
    n_vb = merge.grid[1]
    _, _, _, out, _, _, v, *_, s_out = merge.args  # merge_plan's: part, lse, w_uv, out, splits, heads, v, strides.., out's
    items = {PHASE_PREPARE: t * n_prep, PHASE_SPLIT: split.groups * split.splits, PHASE_MERGE: merge.items}
    phases = [p for p in (PHASE_PREPARE, PHASE_SPLIT, PHASE_MERGE) if items[p] > 0]
    device = split.part.device
    if one_launch is None:
        one_launch = os.environ.get("TRITON_INTERPRET") != "1" and device.type == "cuda"
    if one_launch:
        if programs is None:
            programs = grid_sync.resident_programs(device.index if device.index is not None else torch.cuda.current_device())
        grid = min(programs, max(items.values()))
        launches = [(sum(phases), grid, True)]
        # a counter a grid size: the barrier waits for the next multiple of the grid, so a counter must only ever count
        # arrivals of grids of one size (a 128-program launch after 130-program ones would release early or never)
        bar = grid_sync.counter(device, f"MLA core barrier/{grid}", torch.int64)
    else:  # one launch a phase, each its items' grid (nothing resident at once to wait for, no barrier)
        launches = [(p, items[p], False) for p in phases]
        bar = split.lse
    # the three launches' constexprs under their own names (RANK, ROPE, ACT: shared, checked above), the merge's loop
    # switches renamed apart from prepare's
    merge_loop = {"STAGES": "M_STAGES", "UNROLL": "M_UNROLL"}
    constexprs = {**prep_constexprs, **split.constexprs, **{merge_loop.get(k, k): v for k, v in merge.constexprs.items()}}
    for phase_set, grid, sync in launches:
        _core_kernel[(grid,)](
            *prep_args, n_prep, t, q, rows, idx, ok, lo, hi, part, lse, heads, length, chunk, qk_scale, *split_strides,
            split.groups, split.splits, w_uv, out, v, s_out, n_vb, bar, **constexprs,
            PHASES=phase_set, SYNC=sync, PRELOAD=bool(TUNE["preload"]) and merge.items <= grid,
            num_warps=TUNE["num_warps"], num_stages=split.tune["num_stages"], **pdl.launch_args(q, "merge", "core"))
    return out
