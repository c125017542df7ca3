"""DeepSeek-V3 mixture of experts: noaux_tc sigmoid routing with group-limited top-k, shared experts.

Routing runs in float32 like the reference: the router gate is stored bf16 (as the checkpoints hold it) or float32 and
upcast where used, as HF's F.linear(h.float(), weight.float()) does, so both give the same logits. The selected
experts' weights are read by device indices (no host sync, no data-dependent shapes), so the whole layer can sit inside a CUDA graph: on the CUDA speed
path (EXPERT_IMPL["dense"] == "triton", set by compiled.accelerate) in place by moe_triton.py's grouped
GEMV; otherwise gathered into a [T, k, out, in] copy and applied with einsum (the reference). The router after
its gate GEMV is one Triton kernel on the speed path (ROUTE_IMPL["router"] == "triton", route_triton.py); route_torch()
is the portable path and the kernel's test oracle. With both kernels on and one shared expert of a routed expert's
shape (DeepSeek-V3, GLM-5), moe_grouped runs the layer in 8 launches instead of ~30: the shared expert is one more
row (id -1) of the grouped gate-up and down GEMVs (bf16: moe_triton; fp8: fp8_triton), each token's activation is
read in place by its k+1 rows, and the weighted sum is one batched product. mlp_block is a DeepSeek-family layer's
whole MLP half (norm, MoE or dense MLP, residual add); with BLOCK_IMPL "triton" too, a MoE layer's half is 4 launches
(moe_fused.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tilepd.model_format.block_fp8 import BlockFp8
from tilepd.engine.fp8 import fp8_expert_linear
from tilepd.engine.layers import rms_norm, silu_mul, swiglu
from tilepd.model_format.model_spec import ModelSpec


# "torch": route_torch (portable reference); "triton": route_triton.route_logits after the gate GEMV (CUDA, or CPU
# under TRITON_INTERPRET=1), set by compiled.accelerate(moe_route=True).
ROUTE_IMPL = {"router": "torch"}


def _use_route_kernel(x: torch.Tensor) -> bool:
    if ROUTE_IMPL["router"] != "triton" or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    from tilepd.engine import route_triton

    return route_triton.available()


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, h], gate [E, h] (bf16 or float32, upcast) -> (expert ids [T, k], weights [T, k] float32): one fused kernel
    after the float32 gate GEMV on the speed path, else the torch ops (route_torch)."""
    if _use_route_kernel(x):
        from tilepd.engine.route_triton import route_logits

        return route_logits(F.linear(x.float(), gate.float()), bias, spec.n_group, spec.topk_group, spec.num_experts_per_tok,
                            spec.norm_topk_prob, spec.routed_scaling_factor)
    return route_torch(x, gate, bias, spec)


def route_torch(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference router (noaux_tc as HF's DeepseekV3TopkRouter): sigmoid scores, bias for the choice only,
    groups ranked by their top-2 sum, top-k inside the best topk_group groups, weights from the unbiased scores."""
    t = x.shape[0]
    scores = torch.sigmoid(F.linear(x.float(), gate.float()))
    choice = scores + bias
    groups = choice.view(t, spec.n_group, -1)
    group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
    top_groups = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand_as(groups).reshape(t, -1)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(choice, k=spec.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * spec.routed_scaling_factor


# "gather": w[ids] copy + einsum (portable reference); "triton": moe_triton.expert_gemv (CUDA, or CPU under
# TRITON_INTERPRET=1), for dense expert weights; fp8 experts always go through fp8_expert_linear.
EXPERT_IMPL = {"dense": "gather"}


def _use_gemv(x: torch.Tensor, rows: int) -> bool:
    if EXPERT_IMPL["dense"] != "triton" or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    from tilepd.engine import moe_triton

    return moe_triton.available() and rows <= moe_triton.MAX_ROWS


def experts(x: torch.Tensor, w13: torch.Tensor | BlockFp8, w2: torch.Tensor | BlockFp8, ids: torch.Tensor) -> torch.Tensor:
    """The selected experts' SwiGLU for each token: x [T, h], ids [T, k] -> [T, k, h] (unweighted).

    Dense weights: read in place by the grouped GEMV on the speed path, else gathered by ids
    ([T, k, out, in]) and applied with einsum. fp8 weights: each selected expert's fp8 values and block
    scales are read by its device id (fp8_expert_linear)."""
    t, k = ids.shape
    if isinstance(w13, BlockFp8):
        gu = fp8_expert_linear(x, w13, ids)
    elif _use_gemv(x, t * k):
        from tilepd.engine.moe_triton import expert_gemv

        gu = expert_gemv(x[:, None, :].expand(t, k, x.shape[-1]).reshape(t * k, -1), w13, ids.reshape(-1)).view(t, k, -1)
    else:
        gu = torch.einsum("th,tkoh->tko", x, w13[ids])  # w13[ids]: [T, k, 2*mi, h]
    g, u = gu.chunk(2, dim=-1)
    a = F.silu(g) * u
    if isinstance(w2, BlockFp8):
        return fp8_expert_linear(a, w2, ids)
    if _use_gemv(a, t * k):
        from tilepd.engine.moe_triton import expert_gemv

        return expert_gemv(a.reshape(t * k, -1), w2, ids.reshape(-1)).view(t, k, -1)
    return torch.einsum("tki,tkhi->tkh", a, w2[ids])  # w2[ids]: [T, k, h, mi]


def _grouped_shared(x: torch.Tensor, w: dict, p: str, spec: ModelSpec) -> bool:
    """The speed path's one-launch-per-projection MoE (moe_grouped) applies: router and expert kernels on, and one
    shared expert of a routed expert's shape and format (n_shared_experts 1, as DeepSeek-V3 and GLM-5)."""
    if p + "shared_w13" not in w or EXPERT_IMPL["dense"] != "triton" or not _use_route_kernel(x):
        return False
    w13, w2, s13, s2 = w[p + "experts_w13"], w[p + "experts_w2"], w[p + "shared_w13"], w[p + "shared_w2"]
    rows = x.shape[0] * (spec.num_experts_per_tok + 1)
    if isinstance(w13, BlockFp8):
        from tilepd.engine.fp8 import GEMV_MAX_ROWS, kernel_available

        return (x.is_cuda and x.shape[0] <= GEMV_MAX_ROWS and kernel_available() and isinstance(w2, BlockFp8)
                and all(isinstance(s, BlockFp8) and s.block == e.block and s.weight.shape == e.weight.shape[1:]
                        and s.scale.shape == e.scale.shape[1:] and s.weight.is_contiguous() and s.scale.is_contiguous()
                        for s, e in ((s13, w13), (s2, w2))))
    return (_use_gemv(x, rows) and all(isinstance(s, torch.Tensor) and s.shape == e.shape[1:] and s.dtype == e.dtype and s.is_contiguous()
                                       and e.is_contiguous() for s, e in ((s13, w13), (s2, w2))))


def moe_grouped(x: torch.Tensor, w: dict, p: str, spec: ModelSpec) -> torch.Tensor:
    """moe() in 8 launches (9 with a bf16 gate: its float32 copy): gate GEMV (+ its float cast), the router kernel
    with a shared slot (id -1, weight 1), one grouped gate-up GEMV over the k routed experts and the shared one (each
    token's activation read by its k+1 rows in place), silu-mul, one grouped down GEMV, and the weighted sum over the
    k+1 rows as one batched product. The reference path's separate shared-expert GEMVs, gathers and adds are gone."""
    from tilepd.engine.route_triton import route_logits

    t, k = x.shape[0], spec.num_experts_per_tok
    ids, weights = route_logits(F.linear(x.float(), w[p + "gate"].float()), w[p + "gate_bias"], spec.n_group, spec.topk_group, k,
                                spec.norm_topk_prob, spec.routed_scaling_factor, shared_slot=True, weights_dtype=x.dtype)
    flat = ids.view(-1)
    w13, w2, s13, s2 = w[p + "experts_w13"], w[p + "experts_w2"], w[p + "shared_w13"], w[p + "shared_w2"]
    x = x if x.is_contiguous() else x.contiguous()
    if isinstance(w13, BlockFp8):
        from tilepd.engine import fp8_triton

        gu = fp8_triton.launch(x, w13.weight, w13.scale, flat, None, w13.block[0], w13.block[1], shared=(s13.weight, s13.scale), x_div=k + 1)
        y = fp8_triton.launch(silu_mul(gu), w2.weight, w2.scale, flat, None, w2.block[0], w2.block[1], shared=(s2.weight, s2.scale))
    else:
        from tilepd.engine.moe_triton import expert_gemv

        gu = expert_gemv(x, w13, flat, shared=s13, x_div=k + 1)
        y = expert_gemv(silu_mul(gu), w2, flat, shared=s2)
    return torch.bmm(weights.view(t, 1, k + 1), y.view(t, k + 1, -1)).view(t, -1)


def moe(x: torch.Tensor, w: dict, p: str, spec: ModelSpec) -> torch.Tensor:
    """Routed experts (weighted by the router) plus the shared experts, for T tokens x [T, h]."""
    if _grouped_shared(x, w, p, spec):
        return moe_grouped(x, w, p, spec)
    ids, weights = route(x, w[p + "gate"], w[p + "gate_bias"], spec)
    y = experts(x, w[p + "experts_w13"], w[p + "experts_w2"], ids)
    out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)
    if p + "shared_w13" in w:
        out = out + swiglu(x, w[p + "shared_w13"], w[p + "shared_w2"])
    return out


# "torch": the MLP half of a DeepSeek-family layer as separate ops (rms_norm, moe, the add); "triton": the MoE layers'
# half in 4 launches (moe_fused.py), set by compiled.accelerate(moe_fused=True). It stands on the grouped path's two
# switches (EXPERT_IMPL and ROUTE_IMPL "triton"): with either off the half runs as before.
BLOCK_IMPL = {"moe": "torch"}


def use_fused_block(x: torch.Tensor, w: dict, p: str, spec: ModelSpec) -> bool:
    """The MoE layer `p` runs as moe_fused.moe_block here: its switch and the two it stands on, and the block's own checks."""
    if BLOCK_IMPL["moe"] != "triton" or EXPERT_IMPL["dense"] != "triton" or ROUTE_IMPL["router"] != "triton":
        return False
    from tilepd.engine import moe_fused

    return moe_fused.applies(x, w, p, spec)


def mlp_block(x: torch.Tensor, w: dict, p: str, spec: ModelSpec, is_moe: bool) -> torch.Tensor:
    """x + MLP(rms_norm(x, mlp_norm)) of layer `p` (x: the residual stream [T, H]): MoE layers in 4 launches on the speed
    path (moe_fused.moe_block), else the norm, moe() or the dense SwiGLU, and the add, in that order."""
    if is_moe and use_fused_block(x, w, p, spec):
        from tilepd.engine.moe_fused import moe_block

        return moe_block(x, w, p, spec)
    h = rms_norm(x, w[p + "mlp_norm"], spec.rms_norm_eps)
    return x + (moe(h, w, p, spec) if is_moe else swiglu(h, w[p + "w13"], w[p + "w2"]))
