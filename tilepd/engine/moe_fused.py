"""The MoE half of a DeepSeek-family layer, x + moe(rms_norm(x)), in 4 launches (moe.mlp_block's speed path).

Today's speed path spends ~10 launches on it (the norm, the float cast, the cuBLAS router GEMV, the router kernel, the
grouped gate-up GEMV, silu, mul, the grouped down GEMV, the weighted sum as a bmm, the residual add), each a few
microseconds plus a gap. Here:

1. gate (moe_fused_triton.gate_route): the MLP norm and the float32 router GEMV from the normed row (the gate read as
   stored, bf16 or float32, and upcast in the kernel), then the noaux_tc routing in route_triton's one-warp kernel (a
   launch of its own: measured faster than routing in the gate's last program, TUNE["route_apart"]); it also writes
   the normed row h (bf16) and the routed ids with the shared slot (id -1, weight 1).
2. gate-up (moe_fused_triton.gate_up_act): the grouped GEMV over each token's k routed experts and the shared one,
   reading h in place by its k+1 rows, each program computing the gate and the up outputs of the same columns, with
   silu(gate) * up in its epilogue. The norm is computed once in 1. instead of in this launch's ~2,300 programs (each
   would re-read the row twice); h is the bf16 row the unfused path feeds its GEMVs.
3. down (moe_fused_triton.down_combine): the grouped down GEMV, the weighted sum over the k+1 rows and the residual add.

Each intermediate is rounded to the activation dtype where the unfused path rounds it (normed row, router weights,
gate-up output, silu, its product with up, each expert's down output, the weighted sum, the residual add), so the block
equals norm + moe_grouped + add up to float32 accumulation order (and the router's float32 logits up to theirs: a
near-tie between experts can still flip; the GPU bench counts that).
"""

from __future__ import annotations

import os

import torch

from tilepd.engine.fp8 import GEMV_MAX_ROWS
from tilepd.model_format.block_fp8 import BlockFp8
from tilepd.model_format.model_spec import ModelSpec


def applies(x: torch.Tensor, w: dict, p: str, spec: ModelSpec) -> bool:
    """The fused block can run layer `p` on x [T, H]: Triton on the device (or its CPU interpreter), one shared expert of
    a routed expert's shape and format (DeepSeek-V3, GLM-5), a contiguous bf16 or float32 router gate (upcast in the
    kernel: the same logits), and T within the grouped GEMVs' row bounds (MTP verify rows included); the norm weight in
    x's dtype (else torch's norm would not round to it)."""
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") or x.dim() != 2 or p + "shared_w13" not in w:
        return False
    from tilepd.engine import moe_fused_triton, moe_triton

    if not moe_fused_triton.available():
        return False
    gate, norm, rows = w[p + "gate"], w[p + "mlp_norm"], x.shape[0] * (spec.num_experts_per_tok + 1)
    if gate.dtype not in (torch.float32, torch.bfloat16) or not gate.is_contiguous() or norm.dtype != x.dtype:
        return False
    w13, w2, s13, s2 = w[p + "experts_w13"], w[p + "experts_w2"], w[p + "shared_w13"], w[p + "shared_w2"]
    if isinstance(w13, BlockFp8):
        return (x.shape[0] <= GEMV_MAX_ROWS and isinstance(w2, BlockFp8)
                and all(isinstance(s, BlockFp8) and s.block == e.block and s.weight.shape == e.weight.shape[1:] and s.scale.shape == e.scale.shape[1:]
                        and s.weight.is_contiguous() and s.scale.is_contiguous() and e.weight.is_contiguous() and e.scale.is_contiguous()
                        for s, e in ((s13, w13), (s2, w2))))
    return (rows <= moe_triton.MAX_ROWS and isinstance(w2, torch.Tensor)
            and all(isinstance(s, torch.Tensor) and s.shape == e.shape[1:] and s.dtype == e.dtype and s.is_contiguous() and e.is_contiguous()
                    for s, e in ((s13, w13), (s2, w2))))


def moe_block(x: torch.Tensor, w: dict, p: str, spec: ModelSpec, residual: bool = True) -> torch.Tensor:
    """x + moe(rms_norm(x, mlp_norm)) for the MoE layer `p` in 4 launches (call where `applies`); residual False:
    moe(rms_norm(x)) alone, which tensor parallelism all-reduces (each rank's expert slices) before its own add."""
    from tilepd.engine.moe_fused_triton import down_combine, gate_route, gate_up_act

    k = spec.num_experts_per_tok
    x = x if x.is_contiguous() else x.contiguous()
    h, ids, weights, _ = gate_route(x, w[p + "mlp_norm"], spec.rms_norm_eps, w[p + "gate"], w[p + "gate_bias"], spec.n_group, spec.topk_group, k,
                                    spec.norm_topk_prob, spec.routed_scaling_factor)
    a = gate_up_act(h, w[p + "experts_w13"], w[p + "shared_w13"], ids, shared_last=True)
    return down_combine(a, w[p + "experts_w2"], w[p + "shared_w2"], ids, weights, x if residual else None, shared_last=True)
