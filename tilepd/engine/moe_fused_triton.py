"""The two new kernels of the fused MoE block (moe_fused.py): the gate (norm + router GEMV + routing) and the down
projection with the weighted sum and the residual add.

Gate (`gate_route`): every program recomputes the token row's RMS statistics (the row is a few KB, read from L2), forms
the normed row rounded to the activation dtype where torch rounds it, and computes BLOCK_E router logits in float32 from
it (HF's router: float32 logits of the normed bf16 row against the float32 gate weight). Program (t, 0) also writes the
normed row, which the grouped gate-up GEMV then reads in place. Each program stores its logits, then takes a ticket
from a device counter (a CTA barrier, then one acq_rel atomic: the pattern of CUDA's grid sync); the program that draws
the last ticket routes every token (route_triton.route_row: noaux_tc with the deterministic tie rule, the shared slot
id -1 with weight 1) from the logits, read past L1, and puts the counter back to 0 for the next launch. So the gate
GEMV, the float cast and the router are one launch, and no program waits on another.

Down (`down_combine`): each program owns BLOCK_N output columns of one token and loops over the token's k+1 rows
(routed experts, then the shared one at id -1): silu(gate) * up of the row's gate-up output in the prologue (rounded
where layers.silu_mul rounds), the row's GEMV over the expert's weight (fp8 with block scales, or bf16/fp32), its output
rounded to the activation dtype (the unfused down GEMV's output), times the routing weight and summed in float32 (the
unfused path's batched product), the sum rounded, then the residual added and rounded (the unfused add). No
cross-program reduction, no atomics on the output: the result is deterministic.

Device ids only, static shapes, no host sync: both sit in the decode step's CUDA graph. Under TRITON_INTERPRET=1 they
also run on CPU tensors, which is how tests/engine/test_moe_fused.py checks them against the torch ops.
"""

from __future__ import annotations

import torch

from tilepd.model_format.block_fp8 import BlockFp8
from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
    from tilepd.engine.triton_rows import row_rstd

    from tilepd.engine.route_triton import route_constants, route_row
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

# gate_*: router experts per program, K chunk, warps; down_*: output columns per program, K chunk (fp8 / dense
# weights), warps. Defaults follow the existing kernels' H200 sweeps (fp8_triton: 8 rows x 1024 with 4 warps);
# bench/moe_fused_gpu.py --sweep times the alternatives on the device.
TUNE: dict[str, int] = {
    "gate_block_e": env_int("TILEPD_MOE_FUSED_GATE_BLOCK_E", 2),
    "gate_block_k": env_int("TILEPD_MOE_FUSED_GATE_BLOCK_K", 2048),
    "gate_num_warps": env_int("TILEPD_MOE_FUSED_GATE_WARPS", 8),
    "down_block_n": env_int("TILEPD_MOE_FUSED_DOWN_BLOCK_N", 8),
    "down_block_k_fp8": env_int("TILEPD_MOE_FUSED_DOWN_BLOCK_K_FP8", 1024),
    "down_block_k": env_int("TILEPD_MOE_FUSED_DOWN_BLOCK_K", 512),
    "down_num_warps": env_int("TILEPD_MOE_FUSED_DOWN_WARPS", 4),
}

_COUNTERS: dict[torch.device, torch.Tensor] = {}  # one ticket counter per device, always 0 between launches


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _gate_kernel(X, NW, GATE, BIAS, H, LOGITS, COUNTER, IDS, WTS, T, E, K, s_xr, s_hr, s_ge, s_lr, s_ir, s_wr, eps, scale,
                     BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                     N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                     G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr, NORMALISE: tl.constexpr, SHARED_SLOT: tl.constexpr,
                     N_SLOTS: tl.constexpr):
        r = tl.program_id(0)
        pid_e = tl.program_id(1)
        act = H.dtype.element_ty
        x_row = X + r * s_xr
        rstd = row_rstd(x_row, K, eps, BLOCK_K)
        experts = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        emask = experts < E
        w_rows = GATE + experts.to(tl.int64)[:, None] * s_ge
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < K
            xs = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
            g = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
            hn = (xs * rstd * g).to(act)  # torch's rms_norm (CUDA and CPU): (x * rstd) * w in float32, rounded once
            if pid_e == 0:  # one program per row writes the normed row for the gate-up GEMV
                tl.store(H + r * s_hr + cols, hn, mask=cmask)
            w = tl.load(w_rows + cols[None, :], mask=emask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * hn.to(tl.float32)[None, :], axis=1)
        tl.store(LOGITS + r * s_lr + experts, acc, mask=emask)
        tl.debug_barrier()  # every thread's logits before the ticket's release
        ticket = tl.atomic_add(COUNTER, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last program: all logits are out
            for t in range(T):
                route_row(LOGITS + t * s_lr, BIAS, IDS + t * s_ir, WTS + t * s_wr, scale, N_GROUP, GROUP_SIZE, TOPK_GROUP, TOP_K,
                          G_PAD, GS_PAD, K_PAD, NORMALISE, SHARED_SLOT, N_SLOTS)
            tl.atomic_xchg(COUNTER, 0)

    @triton.jit
    def _down_kernel(GU, W, S, WS, SS, IDS, WTS, RES, Y, N, K, s_gr, s_we, s_wn, s_se, s_sn, s_it, s_wt, s_rr, s_yr,
                     SLOTS: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROW_UNIFORM: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        act = Y.dtype.element_ty
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(SLOTS):
            e = tl.load(IDS + t * s_it + j).to(tl.int64)
            w_base = W + e * s_we
            s_base = S + e * s_se
            if e < 0:  # id -1: the shared expert (one routed expert's shape, scales and strides)
                w_base = WS
                s_base = SS
            w_rows = w_base + rows.to(tl.int64)[:, None] * s_wn
            gu_row = GU + (t * SLOTS + j) * s_gr
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < K
                gate = tl.load(gu_row + cols, mask=cmask, other=0.0).to(tl.float32)
                up = tl.load(gu_row + K + cols, mask=cmask, other=0.0).to(tl.float32)
                a = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)  # silu, rounded as F.silu's output
                a = (a * up).to(act).to(tl.float32)  # times up, rounded as the product
                w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                if FP8:
                    if ROW_UNIFORM:  # the tile's rows share one row block: its scales fold into the activations
                        s = tl.load(s_base + (pid_n * BLOCK_N // BN) * s_sn + cols // BK, mask=cmask, other=0.0)
                        acc += tl.sum(w * (a * s)[None, :], axis=1)
                    else:  # per-row block scales (rows off block boundaries)
                        s = tl.load(s_base + (rows // BN)[:, None] * s_sn + (cols // BK)[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
                        acc += tl.sum(w * s * a[None, :], axis=1)
                else:
                    acc += tl.sum(w * a[None, :], axis=1)
            y = acc.to(act).to(tl.float32)  # the expert's down output in the activation dtype
            total += tl.load(WTS + t * s_wt + j).to(tl.float32) * y
        out = total.to(act).to(tl.float32) + tl.load(RES + t * s_rr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(Y + t * s_yr + rows, out.to(act), mask=rmask)


def _counter(device: torch.device) -> torch.Tensor:
    """The device's ticket counter. Made at the first (uncaptured: capture_graph warms up first) call; a counter first
    made inside a capture would be zeroed only by the graph's replays, so that is refused by name."""
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused MoE gate: its ticket counter is made by an uncaptured call; run the step once before capturing it")
        c = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return c


def gate_route(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
               top_k: int, norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] (the residual stream), the MLP norm's weight [H], the router gate [E, H] (float32) and correction bias [E]
    -> (normed rows h [T, H] in x's dtype, ids [T, top_k + 1] int64 ending in the shared slot -1, weights [T, top_k + 1] in
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
        x, norm_weight, gate, bias, h, logits, _counter(x.device), ids, weights, t, n_exp, k, x.stride(0), h.stride(0), gate.stride(0),
        logits.stride(0), ids.stride(0), weights.stride(0), float(eps), float(routed_scaling_factor),
        BLOCK_E=block_e, BLOCK_K=block_k, **consts, num_warps=TUNE["gate_num_warps"])
    return h, ids, weights, logits


def down_combine(gu: torch.Tensor, w2: torch.Tensor | BlockFp8, shared: torch.Tensor | BlockFp8, ids: torch.Tensor, weights: torch.Tensor,
                 residual: torch.Tensor) -> torch.Tensor:
    """gu [T * S, 2 * I] (each token's S = k + 1 gate-up rows, [gate | up]), the stacked down weights w2 [E, H, I] and the
    shared expert's [H, I] (both bf16/fp32 or both block-scaled fp8), ids and weights [T, S] -> residual + sum over the S
    rows of weight * down(silu(gate) * up): [T, H] in gu's dtype, in one launch."""
    if triton is None:
        raise RuntimeError("fused MoE down kernel needs Triton, which is not importable here")
    fp8 = isinstance(w2, BlockFp8)
    if fp8 != isinstance(shared, BlockFp8):
        raise ValueError("fused MoE down: the routed and the shared expert weights must both be fp8 or both dense")
    wt, st = (w2.weight, shared.weight) if fp8 else (w2, shared)
    if wt.dim() != 3 or st.shape != wt.shape[1:] or st.stride() != wt.stride()[1:] or st.dtype != wt.dtype or wt.stride(-1) != 1:
        raise ValueError(f"fused MoE down: shared expert {list(st.shape)} {st.dtype} strides {st.stride()} must match one routed expert "
                         f"{list(wt.shape[1:])} {wt.dtype} strides {wt.stride()[1:]}, contiguous along I")
    if fp8 and (w2.block != shared.block or shared.scale.shape != w2.scale.shape[1:] or shared.scale.stride() != w2.scale.stride()[1:]
                or w2.scale.stride(-1) != 1):
        raise ValueError(f"fused MoE down: shared expert's scales {list(shared.scale.shape)} (block {list(shared.block)}) must match a routed "
                         f"expert's {list(w2.scale.shape[1:])} (block {list(w2.block)}) in shape and strides")
    t, slots = ids.shape
    n, k = wt.shape[1], wt.shape[2]
    if (gu.dim() != 2 or gu.shape != (t * slots, 2 * k) or gu.stride(-1) != 1 or weights.shape != ids.shape
            or residual.shape != (t, n) or residual.stride(-1) != 1):
        raise ValueError(f"fused MoE down: gu {list(gu.shape)}, ids {list(ids.shape)}, weights {list(weights.shape)}, residual "
                         f"{list(residual.shape)} do not fit the [{n}, {k}] experts (gu [T*S, 2I] contiguous, ids/weights [T, S], residual [T, H])")
    y = torch.empty(t, n, dtype=gu.dtype, device=gu.device)
    if t == 0:
        return y
    block_n = TUNE["down_block_n"]
    block_k = min(TUNE["down_block_k_fp8" if fp8 else "down_block_k"], triton.next_power_of_2(k))
    bn, bk = w2.block if fp8 else (1, 1)
    scale, s_scale = (w2.scale, shared.scale) if fp8 else (wt, st)  # dense: unused stand-ins
    _down_kernel[(t, triton.cdiv(n, block_n))](
        gu, wt, scale, st, s_scale, ids, weights, residual, y, n, k, gu.stride(0), wt.stride(0), wt.stride(1),
        w2.scale.stride(0) if fp8 else 0, w2.scale.stride(1) if fp8 else 0, ids.stride(0), weights.stride(0), residual.stride(0), y.stride(0),
        SLOTS=slots, FP8=fp8, BN=bn, BK=bk, ROW_UNIFORM=fp8 and bn % block_n == 0, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=TUNE["down_num_warps"])
    return y
