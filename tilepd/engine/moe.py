"""DeepSeek-V3 mixture of experts: noaux_tc sigmoid routing with group-limited top-k, shared experts.

Routing runs in float32 like the reference. The selected experts' weights are read by device indices
(no host sync, no data-dependent shapes), so the whole layer can sit inside a CUDA graph: on the CUDA speed
path (EXPERT_IMPL["dense"] == "triton", set by compiled.accelerate) in place by moe_triton.py's grouped
GEMV; otherwise gathered into a [T, k, out, in] copy and applied with einsum (the reference). The router after
its gate GEMV is one Triton kernel on the speed path (ROUTE_IMPL["router"] == "triton", route_triton.py); route_torch()
is the portable path and the kernel's test oracle.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tilepd.engine.fp8 import BlockFp8, fp8_expert_linear
from tilepd.engine.layers import swiglu
from tilepd.engine.spec import ModelSpec


# "torch": route_torch (portable reference); "triton": route_triton.route_logits after the gate GEMV (CUDA, or CPU
# under TRITON_INTERPRET=1), set by compiled.accelerate(moe_route=True).
ROUTE_IMPL = {"router": "torch"}


def _use_route_kernel(x: torch.Tensor) -> bool:
    if ROUTE_IMPL["router"] != "triton" or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    from tilepd.engine import route_triton

    return route_triton.available()


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, h] -> (expert ids [T, k], weights [T, k] float32): one fused kernel after the gate GEMV on the speed
    path, else the torch ops (route_torch)."""
    if _use_route_kernel(x):
        from tilepd.engine.route_triton import route_logits

        return route_logits(F.linear(x.float(), gate), bias, spec.n_group, spec.topk_group, spec.num_experts_per_tok,
                            spec.norm_topk_prob, spec.routed_scaling_factor)
    return route_torch(x, gate, bias, spec)


def route_torch(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference router (noaux_tc as HF's DeepseekV3TopkRouter): sigmoid scores, bias for the choice only,
    groups ranked by their top-2 sum, top-k inside the best topk_group groups, weights from the unbiased scores."""
    t = x.shape[0]
    scores = torch.sigmoid(F.linear(x.float(), gate))
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


def moe(x: torch.Tensor, w: dict, p: str, spec: ModelSpec) -> torch.Tensor:
    """Routed experts (weighted by the router) plus the shared experts, for T tokens x [T, h]."""
    ids, weights = route(x, w[p + "gate"], w[p + "gate_bias"], spec)
    y = experts(x, w[p + "experts_w13"], w[p + "experts_w2"], ids)
    out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)
    if p + "shared_w13" in w:
        out = out + swiglu(x, w[p + "shared_w13"], w[p + "shared_w2"])
    return out
