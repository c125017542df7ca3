"""The fused MoE block's kernels (moe_fused.py): the gate (norm + router GEMV + routing), the grouped gate-up GEMV with
silu(gate) * up in its epilogue, and the down projection with the weighted sum and the residual add.

Gate (`gate_route`): every program computes BLOCK_E router logits in float32 from the token row's normed row (HF's
router: float32 logits of the normed bf16 row against the gate weight upcast to float32; the weight is read as stored,
bf16 as the checkpoints hold it, or float32). While the row fits one K chunk (the
served shapes: H 6144 / 7168 in an 8192 chunk) a program issues its gate rows' load first, then reads the row once for
both its RMS statistics and the dot, so the ~24 KB a program reads are in flight together (the chunked loop of the
first version read the row twice and the weights in 3 serial chunks: ~10 us for 1.5 us of bytes). Program (t, 0) also
writes the normed row, which the gate-up GEMV reads in place. Each program stores its logits; route_triton's one-warp
kernel then routes them (noaux_tc with the deterministic tie rule, the shared slot id -1 with weight 1) as the next
launch (TUNE["route_apart"], the default). With route_apart 0 each program takes a ticket from a device counter
instead (a CTA barrier, then one acq_rel atomic: the pattern of CUDA's grid sync) and the program that draws the last
ticket routes every token (route_triton.route_row) from the logits, read past L1, and puts the counter back to 0 for
the next launch: one launch fewer, but its 8-warp routing tail measured slower than the launch (docs/PERFORMANCE.md).

Gate-up (`gate_up_act`): row r (a (token, slot) pair) computes BLOCK_N gate outputs and the BLOCK_N up outputs of the
same columns of expert ids[r] (rows n and I + n of [gate; up], fp8 with block scales or bf16/fp32), each rounded to the
activation dtype (the unfused GEMV's output), then silu(gate) rounded (F.silu's output) times up rounded (the product):
the activation a [T * S, I] the down GEMV needs. So silu-mul runs once per element instead of once per down program
(the first version recomputed it, from a twice-as-wide row, in each of the ~800 down programs).

Down (`down_combine`): each program owns BLOCK_N output columns of one token and walks the token's k+1 rows (routed
experts, then the shared one at id -1), each row's K chunks unrolled so they are in flight together and the next row's
expert id loaded a row ahead (the first version's K loop and its id load left gaps with nothing in flight, and its
silu-mul prologue read a twice-as-wide row; rows fully unrolled measured slower: registers cut the programs per SM):
the row's GEMV over the expert's weight, its output rounded to the activation dtype (the unfused down GEMV's output),
times the routing weight and summed in float32 (the unfused path's batched product), the sum rounded, then the residual
added and rounded (the unfused add). No cross-program reduction, no atomics on the output: the result is deterministic.

Device ids only, static shapes, no host sync: all three sit in the decode step's CUDA graph. Under TRITON_INTERPRET=1
they also run on CPU tensors, which is how tests/engine/test_moe_fused.py checks them against the torch ops.
"""

from __future__ import annotations

import torch

from tilepd.model_format.block_fp8 import BlockFp8
from tilepd.engine import grid_sync, pdl
from tilepd.engine.fp8_triton import same_layout
from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
    from tilepd.engine.fp8_triton import _chunk_scales, _fold_scales
    from tilepd.engine.pdl import prefetch_l2, trigger, wait
    from tilepd.engine.triton_rows import row_rstd

    from tilepd.engine.route_triton import route_constants, route_logits, route_row
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

# gate_*: router experts per program, K chunk (>= H: one chunk), warps; up_*: activation columns per program (fp8 / dense
# weights: 2x as many weight rows), K chunk, warps; down_*: output columns per program (0: picked, _down_tile), K chunk
# (fp8: 0 picked with the columns), warps. Defaults from bench/moe_fused_gpu.py --sweep on one H200 (2026-12-03, GLM-5.1
# and DeepSeek-V3 MoE layers, T = 1, bf16 and fp8; docs/PERFORMANCE.md); --sweep times the alternatives on the device.
TUNE: dict[str, int] = {
    "gate_block_e": env_int("TILEPD_MOE_FUSED_GATE_BLOCK_E", 2),
    "gate_block_k": env_int("TILEPD_MOE_FUSED_GATE_BLOCK_K", 8192),
    "gate_num_warps": env_int("TILEPD_MOE_FUSED_GATE_WARPS", 8),
    "up_block_n_fp8": env_int("TILEPD_MOE_FUSED_UP_BLOCK_N_FP8", 8),
    "up_block_n": env_int("TILEPD_MOE_FUSED_UP_BLOCK_N", 16),
    "up_block_k_fp8": env_int("TILEPD_MOE_FUSED_UP_BLOCK_K_FP8", 512),
    "up_block_k": env_int("TILEPD_MOE_FUSED_UP_BLOCK_K", 512),
    "up_num_warps": env_int("TILEPD_MOE_FUSED_UP_WARPS", 4),
    # fp8 gate-up launches of fewer than up_few programs (a TP shard's experts: 256 rows at TP8) take the narrow, long
    # tile: each program's K loop is its latency chain, so half the rows and twice the chunk halve it. On an H100
    # (2026-12-06): the TP8 shard of GLM-5.1 fp8, 288 programs, 5.95-6.00 -> 5.71 ms a step (gate-up 17.1 -> 14.0 us a
    # layer; 2 rows x 2048 and 4 x 2048: 5.82); the whole models (2304 programs) lost with it (GLM-5.1 17.46 -> 17.55
    # ms, DeepSeek-V3 15.99 -> 16.12), so they keep the tile above.
    "up_few": env_int("TILEPD_MOE_FUSED_UP_FEW", 1024),
    "up_block_n_fp8_few": env_int("TILEPD_MOE_FUSED_UP_BLOCK_N_FP8_FEW", 4),
    "up_block_k_fp8_few": env_int("TILEPD_MOE_FUSED_UP_BLOCK_K_FP8_FEW", 1024),
    "down_block_n": env_int("TILEPD_MOE_FUSED_DOWN_BLOCK_N", 0),
    "down_block_k_fp8": env_int("TILEPD_MOE_FUSED_DOWN_BLOCK_K_FP8", 0),
    "down_block_k": env_int("TILEPD_MOE_FUSED_DOWN_BLOCK_K", 1024),
    "down_num_warps": env_int("TILEPD_MOE_FUSED_DOWN_WARPS", 4),
    # 1: the gate kernel stops at the logits (no ticket, no routing tail in its last program) and route_triton's one-warp
    # kernel routes them as a launch of its own; 0: the last program routes (8 warps). 1 measured faster on one H100
    # (2026-12-06, three paired runs, 1K: GLM-5.1 fp8 78L 17.47-17.53 -> 17.40 ms/token, gate + route 8.7 -> 7.1 us a
    # layer; TP8 shard 6.03-6.08 -> 5.93-6.04 ms a step; DeepSeek-V3 fp8 61L level, one run); docs/PERFORMANCE.md
    "route_apart": env_int("TILEPD_MOE_ROUTE_APART", 1),
}
_DOWN_PROGRAMS = 6 * 132  # fp8 down: 8-column tiles while they make at most ~6 programs per H200 SM, else 4-column ones

def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _gate_kernel(X, NW, GATE, BIAS, H, LOGITS, COUNTER, IDS, WTS, T, E, s_xr, s_hr, s_ge, s_lr, s_ir, s_wr, eps, scale,
                     K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                     N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                     G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr, NORMALISE: tl.constexpr, SHARED_SLOT: tl.constexpr,
                     N_SLOTS: tl.constexpr, ROUTE: tl.constexpr = True, PDL: tl.constexpr = False):
        r = tl.program_id(0)
        pid_e = tl.program_id(1)
        act = H.dtype.element_ty
        x_row = X + r * s_xr
        experts = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        emask = experts < E
        w_rows = GATE + experts.to(tl.int64)[:, None] * s_ge
        if BLOCK_K >= K:  # one chunk: the gate rows' load first (DRAM), then the row once (L2) for its norm and the dot
            cols = tl.arange(0, BLOCK_K)
            cmask = cols < K
            w = tl.load(w_rows + cols[None, :], mask=emask[:, None] & cmask[None, :], other=0.0)
            wait(PDL)  # the weights are not the step's: their load is in flight before the wait (pdl.py), the row after
            xs = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
            g = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=0) / K + eps)
            hn = (xs * rstd * g).to(act)  # torch's rms_norm (CUDA and CPU): (x * rstd) * w in float32, rounded once
            if pid_e == 0:  # one program per row writes the normed row for the gate-up GEMV
                tl.store(H + r * s_hr + cols, hn, mask=cmask)
            acc = tl.sum(w.to(tl.float32) * hn.to(tl.float32)[None, :], axis=1)
        else:
            wait(PDL)
            rstd = row_rstd(x_row, K, eps, BLOCK_K)
            acc = tl.zeros([BLOCK_E], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < K
                xs = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
                g = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
                hn = (xs * rstd * g).to(act)
                if pid_e == 0:
                    tl.store(H + r * s_hr + cols, hn, mask=cmask)
                w = tl.load(w_rows + cols[None, :], mask=emask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(w * hn.to(tl.float32)[None, :], axis=1)
        tl.store(LOGITS + r * s_lr + experts, acc, mask=emask)
        if ROUTE:  # else route_triton's one-warp kernel routes the logits as the next launch
            tl.debug_barrier()  # every thread's logits before the ticket's release
            ticket = tl.atomic_add(COUNTER, 1, sem="acq_rel")
            if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last program: all logits are out
                for t in range(T):
                    route_row(LOGITS + t * s_lr, BIAS, IDS + t * s_ir, WTS + t * s_wr, scale, N_GROUP, GROUP_SIZE, TOPK_GROUP, TOP_K,
                              G_PAD, GS_PAD, K_PAD, NORMALISE, SHARED_SLOT, N_SLOTS)
                tl.atomic_xchg(COUNTER, 0)
        trigger(PDL)  # pdl.py: the late form triggers here

    @triton.jit
    def _gate_up_kernel(X, W, S, WS, SS, IDS, A, I, K, s_xr, s_we, s_wn, s_se, s_sn, s_ar,
                        X_DIV: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROW_UNIFORM: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                        PF_LINES: tl.constexpr = 1, ESIZE: tl.constexpr = 1):
        r = tl.program_id(0)
        pid_n = tl.program_id(1)
        act = A.dtype.element_ty
        cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols_n < I
        if PREFETCH:  # the last slot of each token is the shared expert (gate_route's ids): its rows are known before
            if r % X_DIV == X_DIV - 1:  # the routing is, so its tile goes to L2 while the gate kernel runs (pdl.py)
                pf = tl.arange(0, PF_LINES) * (128 // ESIZE)
                pf_rows = WS + cols_n.to(tl.int64)[:, None] * s_wn + pf[None, :]
                pf_mask = nmask[:, None] & (pf < K)[None, :]
                prefetch_l2(pf_rows, pf_mask)
                prefetch_l2(pf_rows + I * s_wn, pf_mask)
        wait(PDL)
        e = tl.load(IDS + r).to(tl.int64)
        w_base = W + e * s_we
        s_base = S + e * s_se
        if e < 0:  # id -1: the shared expert (one routed expert's shape, scales and strides)
            w_base = WS
            s_base = SS
        g_rows = w_base + cols_n.to(tl.int64)[:, None] * s_wn  # gate rows n; the up rows are I + n
        u_rows = g_rows + I * s_wn
        x_row = X + (r // X_DIV) * s_xr
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < K
            wmask = nmask[:, None] & cmask[None, :]
            wg = tl.load(g_rows + cols[None, :], mask=wmask, other=0.0).to(tl.float32)
            wu = tl.load(u_rows + cols[None, :], mask=wmask, other=0.0).to(tl.float32)
            x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
            if FP8:  # ROW_UNIFORM: the tile's gate rows share one row block, so do its up rows (I % BN == 0)
                sg = _chunk_scales(s_base, cols_n, nmask, pid_n * BLOCK_N, s_sn, cols, cmask, BN, BK, ROW_UNIFORM)
                su = _chunk_scales(s_base, I + cols_n, nmask, I + pid_n * BLOCK_N, s_sn, cols, cmask, BN, BK, ROW_UNIFORM)
                acc_g += tl.sum(_fold_scales(wg, sg, x, ROW_UNIFORM), axis=1)
                acc_u += tl.sum(_fold_scales(wu, su, x, ROW_UNIFORM), axis=1)
            else:
                acc_g += tl.sum(wg * x[None, :], axis=1)
                acc_u += tl.sum(wu * x[None, :], axis=1)
        gate = acc_g.to(act).to(tl.float32)  # the gate-up GEMV's outputs in the activation dtype
        up = acc_u.to(act).to(tl.float32)
        a = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)  # silu, rounded as F.silu's output
        tl.store(A + r * s_ar + cols_n, (a * up).to(act), mask=nmask)  # times up, rounded as the product
        trigger(PDL)  # pdl.py: the late form triggers here

    @triton.jit
    def _down_kernel(A, W, S, WS, SS, IDS, WTS, RES, Y, N, s_ar, s_we, s_wn, s_se, s_sn, s_it, s_wt, s_rr, s_yr,
                     K: tl.constexpr, SLOTS: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     ROW_UNIFORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                     PREFETCH: tl.constexpr = False, PF_LINES: tl.constexpr = 1, ESIZE: tl.constexpr = 1, SHARED_FIRST: tl.constexpr = False,
                     HAS_RES: tl.constexpr = True):
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        act = Y.dtype.element_ty
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        if PREFETCH:  # the shared expert's tile (the last slot, known before the routing) into L2 before the wait (pdl.py)
            pf = tl.arange(0, PF_LINES) * (128 // ESIZE)
            prefetch_l2(WS + rows.to(tl.int64)[:, None] * s_wn + pf[None, :], rmask[:, None] & (pf < K)[None, :])
        wait(PDL)
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        # SHARED_FIRST: the slots in the order S-1, 0, 1, .., S-2: the shared expert (prefetched) first
        e = tl.load(IDS + t * s_it + (SLOTS - 1 if SHARED_FIRST else 0)).to(tl.int64)
        for jj in range(SLOTS):
            j = (jj + SLOTS - 1) % SLOTS if SHARED_FIRST else jj
            j_next = jj if SHARED_FIRST else tl.minimum(jj + 1, SLOTS - 1)
            e_next = tl.load(IDS + t * s_it + tl.minimum(j_next, SLOTS - 1)).to(tl.int64)  # a row ahead: no wait on it
            w_base = W + e * s_we
            s_base = S + e * s_se
            if e < 0:  # id -1: the shared expert (one routed expert's shape, scales and strides)
                w_base = WS
                s_base = SS
            w_rows = w_base + rows.to(tl.int64)[:, None] * s_wn
            a_row = A + (t * SLOTS + j) * s_ar
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: the row's chunks are in flight together
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < K
                w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                a = tl.load(a_row + cols, mask=cmask, other=0.0).to(tl.float32)
                if FP8:
                    s = _chunk_scales(s_base, rows, rmask, pid_n * BLOCK_N, s_sn, cols, cmask, BN, BK, ROW_UNIFORM)
                    acc += tl.sum(_fold_scales(w, s, a, ROW_UNIFORM), axis=1)
                else:
                    acc += tl.sum(w * a[None, :], axis=1)
            total += tl.load(WTS + t * s_wt + j).to(tl.float32) * acc.to(act).to(tl.float32)  # the expert's output, rounded
            e = e_next
        out = total.to(act)
        if HAS_RES:
            out = (out.to(tl.float32) + tl.load(RES + t * s_rr + rows, mask=rmask, other=0.0).to(tl.float32)).to(act)
        tl.store(Y + t * s_yr + rows, out, mask=rmask)
        trigger(PDL)  # pdl.py: the late form triggers here


def gate_route(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
               top_k: int, norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] (the residual stream), the MLP norm's weight [H], the router gate [E, H] (bf16 or float32, upcast) and
    correction bias [E] -> (normed rows h [T, H] in x's dtype, ids [T, top_k + 1] int64 ending in the shared slot -1, weights [T, top_k + 1] in
    x's dtype ending in 1, router logits [T, E] float32), in one launch. The normed row is rounded once, as torch's
    rms_norm (layers.rms_norm) rounds it; HF's module rounds twice (after the scaling and after the weight)."""
    if triton is None:
        raise RuntimeError("fused MoE gate kernel needs Triton, which is not importable here")
    if x.dim() != 2 or gate.dim() != 2 or gate.shape[1] != x.shape[1] or norm_weight.shape != (x.shape[1],) or bias.shape != (gate.shape[0],):
        raise ValueError(f"fused MoE gate: x {list(x.shape)}, norm weight {list(norm_weight.shape)}, gate {list(gate.shape)}, bias "
                         f"{list(bias.shape)} do not fit (x [T, H], norm [H], gate [E, H], bias [E])")
    if x.stride(-1) != 1 or gate.stride(-1) != 1 or not norm_weight.is_contiguous() or not bias.is_contiguous():
        raise ValueError("fused MoE gate: x and gate must be contiguous along H, the norm weight and the bias contiguous")
    t, k = x.shape
    n_exp = gate.shape[0]
    consts = route_constants(n_exp, n_group, topk_group, top_k, norm_topk_prob, shared_slot=True)
    h = torch.empty_like(x, memory_format=torch.contiguous_format)
    logits = torch.empty(t, n_exp, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, consts["N_SLOTS"], dtype=torch.int64, device=x.device)
    weights = torch.empty(t, consts["N_SLOTS"], dtype=x.dtype, device=x.device)
    if t == 0:
        return h, ids, weights, logits
    block_e = TUNE["gate_block_e"]
    block_k = min(TUNE["gate_block_k"], triton.next_power_of_2(k))
    _gate_kernel[(t, triton.cdiv(n_exp, block_e))](
        x, norm_weight, gate, bias, h, logits, grid_sync.counter(x.device, "fused MoE gate ticket"), ids, weights, t, n_exp, x.stride(0), h.stride(0), gate.stride(0),
        logits.stride(0), ids.stride(0), weights.stride(0), float(eps), float(routed_scaling_factor),
        K=k, BLOCK_E=block_e, BLOCK_K=block_k, **consts, ROUTE=not TUNE["route_apart"], num_warps=TUNE["gate_num_warps"],
        **pdl.launch_args(x, "gate"))
    if TUNE["route_apart"]:
        ids, weights = route_logits(logits, bias, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor, shared_slot=True,
                                    weights_dtype=x.dtype)
    return h, ids, weights, logits


def _expert_parts(w: torch.Tensor | BlockFp8, shared: torch.Tensor | BlockFp8, what: str) -> tuple:
    """(weight, shared weight, scale, shared scale, fp8, block) of stacked experts [E, N, K] and the shared expert [N, K],
    after refusing by name a shared expert that is not one routed expert's shape, format and strides (it is read through
    the routed experts' strides)."""
    fp8 = isinstance(w, BlockFp8)
    if fp8 != isinstance(shared, BlockFp8):
        raise ValueError(f"fused MoE {what}: the routed and the shared expert weights must both be fp8 or both dense")
    wt, st = (w.weight, shared.weight) if fp8 else (w, shared)
    if wt.dim() != 3 or not same_layout(st, wt[0]) or st.dtype != wt.dtype or wt.stride(-1) != 1:
        raise ValueError(f"fused MoE {what}: shared expert {list(st.shape)} {st.dtype} strides {st.stride()} must match one routed expert "
                         f"{list(wt.shape[1:])} {wt.dtype} strides {wt.stride()[1:]}, contiguous along K")
    if fp8 and (w.block != shared.block or not same_layout(shared.scale, w.scale[0]) or w.scale.stride(-1) != 1):
        raise ValueError(f"fused MoE {what}: shared expert's scales {list(shared.scale.shape)} (block {list(shared.block)}) must match a "
                         f"routed expert's {list(w.scale.shape[1:])} (block {list(w.block)}) in shape and strides")
    if fp8:
        return wt, st, w.scale, shared.scale, True, w.block
    return wt, st, wt, st, False, (1, 1)  # dense: the weights stand in for the unused scale pointers


def _prefetch_lines(k: int, esize: int) -> int:
    """128-byte lines of one weight row of k elements of esize bytes, rounded up to a power of two (the kernels mask the rest)."""
    return triton.next_power_of_2(max(1, -(-k * esize // 128)))


def gate_up_act(h: torch.Tensor, w13: torch.Tensor | BlockFp8, shared: torch.Tensor | BlockFp8, ids: torch.Tensor,
                shared_last: bool = False) -> torch.Tensor:
    """h [T, H] (the normed rows), the stacked [gate; up] weights w13 [E, 2I, H] and the shared expert's [2I, H] (both
    bf16/fp32 or both block-scaled fp8), ids [T, S] (id -1: the shared expert) -> a [T * S, I] in h's dtype, row
    t * S + j = silu(h[t] @ gate_e.T) * (h[t] @ up_e.T) for e = ids[t, j], rounded as the unfused GEMV + silu_mul, in one
    launch. shared_last: ids[:, -1] is -1 (gate_route's ids), so with PDL the shared expert's rows are prefetched before
    the kernel waits for the routing."""
    if triton is None:
        raise RuntimeError("fused MoE gate-up kernel needs Triton, which is not importable here")
    wt, st, scale, s_scale, fp8, (bn, bk) = _expert_parts(w13, shared, "gate-up")
    t, slots = ids.shape
    two_i, k = wt.shape[1], wt.shape[2]
    if h.dim() != 2 or h.shape != (t, k) or h.stride(-1) != 1 or two_i % 2 or ids.stride(-1) != 1 or ids.stride(0) != slots:
        raise ValueError(f"fused MoE gate-up: h {list(h.shape)} and ids {list(ids.shape)} do not fit the [{two_i}, {k}] experts "
                         "(h [T, H] contiguous along H, ids [T, S] contiguous, an even number of [gate; up] rows)")
    inter = two_i // 2
    a = torch.empty(t * slots, inter, dtype=h.dtype, device=h.device)
    if t == 0:
        return a
    block_n, block_k = TUNE["up_block_n_fp8" if fp8 else "up_block_n"], TUNE["up_block_k_fp8" if fp8 else "up_block_k"]
    if fp8 and t * slots * triton.cdiv(inter, block_n) < TUNE["up_few"]:  # few programs: the narrow, long tile
        block_n, block_k = TUNE["up_block_n_fp8_few"], TUNE["up_block_k_fp8_few"]
    block_k = min(block_k, triton.next_power_of_2(k))
    _gate_up_kernel[(t * slots, triton.cdiv(inter, block_n))](
        h, wt, scale, st, s_scale, ids, a, inter, k, h.stride(0), wt.stride(0), wt.stride(1), scale.stride(0) if fp8 else 0,
        scale.stride(1) if fp8 else 0, a.stride(0),
        X_DIV=slots, FP8=fp8, BN=bn, BK=bk, ROW_UNIFORM=fp8 and bn % block_n == 0 and inter % bn == 0, BLOCK_N=block_n, BLOCK_K=block_k,
        PREFETCH=shared_last and pdl.prefetch_flag(h, "gate_up"), PF_LINES=_prefetch_lines(k, wt.element_size()), ESIZE=wt.element_size(),
        num_warps=TUNE["up_num_warps"], **pdl.launch_args(h, "gate_up"))
    return a


def _down_tile(n: int, t: int, fp8: bool) -> tuple[int, int]:
    """(output columns, K chunk) of a down program. Forced by TUNE where set; else dense 8 columns, and fp8 8 columns x
    1024 while that makes at most _DOWN_PROGRAMS programs, 4 x 2048 beyond: the sweep's fastest on the two served
    shapes (GLM-5.1, H 6144: 768 programs, 8 x 1024 31.2 us against 36.7; DeepSeek-V3, H 7168: 896 programs, 4 x 2048
    39.0 us against 46.0). A rule fitted to those two points, not a model of the device; re-sweep for other shapes."""
    forced = TUNE["down_block_n"]
    if not fp8:
        return forced or 8, TUNE["down_block_k"]
    block_n = forced or (8 if -(-n // 8) * t <= _DOWN_PROGRAMS else 4)
    return block_n, TUNE["down_block_k_fp8"] or (1024 if block_n >= 8 else 2048)


def down_combine(a: torch.Tensor, w2: torch.Tensor | BlockFp8, shared: torch.Tensor | BlockFp8, ids: torch.Tensor, weights: torch.Tensor,
                 residual: torch.Tensor | None, shared_last: bool = False) -> torch.Tensor:
    """a [T * S, I] (each token's S = k + 1 rows of silu(gate) * up, gate_up_act's output), the stacked down weights w2
    [E, H, I] and the shared expert's [H, I] (both bf16/fp32 or both block-scaled fp8), ids and weights [T, S] -> residual
    + sum over the S rows of weight * down(a): [T, H] in a's dtype, in one launch (residual None: the sum alone, which
    tensor parallelism all-reduces before its own add). shared_last: ids[:, -1] is -1
    (gate_route's ids): with PDL the shared expert's tile is prefetched before the wait and summed first (the sum's
    order changes by one term, within float32 rounding)."""
    if triton is None:
        raise RuntimeError("fused MoE down kernel needs Triton, which is not importable here")
    wt, st, scale, s_scale, fp8, (bn, bk) = _expert_parts(w2, shared, "down")
    t, slots = ids.shape
    n, k = wt.shape[1], wt.shape[2]
    if (a.dim() != 2 or a.shape != (t * slots, k) or a.stride(-1) != 1 or weights.shape != ids.shape
            or (residual is not None and (residual.shape != (t, n) or residual.stride(-1) != 1))):
        raise ValueError(f"fused MoE down: a {list(a.shape)}, ids {list(ids.shape)}, weights {list(weights.shape)}, residual "
                         f"{None if residual is None else list(residual.shape)} do not fit the [{n}, {k}] experts (a [T*S, I] "
                         "contiguous, ids/weights [T, S], residual [T, H])")
    y = torch.empty(t, n, dtype=a.dtype, device=a.device)
    if t == 0:
        return y
    block_n, block_k = _down_tile(n, t, fp8)
    block_k = min(block_k, triton.next_power_of_2(k))
    _down_kernel[(t, triton.cdiv(n, block_n))](
        a, wt, scale, st, s_scale, ids, weights, residual if residual is not None else y, y, n, a.stride(0), wt.stride(0), wt.stride(1),
        scale.stride(0) if fp8 else 0, scale.stride(1) if fp8 else 0, ids.stride(0), weights.stride(0),
        residual.stride(0) if residual is not None else 0, y.stride(0),
        K=k, SLOTS=slots, FP8=fp8, BN=bn, BK=bk, ROW_UNIFORM=fp8 and bn % block_n == 0, BLOCK_N=block_n, BLOCK_K=block_k,
        PREFETCH=shared_last and pdl.prefetch_flag(a, "down"), PF_LINES=_prefetch_lines(k, wt.element_size()), ESIZE=wt.element_size(),
        SHARED_FIRST=shared_last and pdl.prefetch_flag(a, "down"), HAS_RES=residual is not None, num_warps=TUNE["down_num_warps"],
        **pdl.launch_args(a, "down"))
    return y
