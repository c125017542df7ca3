"""The DeepSeek-V3 / GLM-5 MoE router (noaux_tc) after the gate GEMV as one Triton kernel: ids and weights per token.

Why: moe.route() in torch is ~10 launches per MoE layer on the decode step (sigmoid, + bias, a top-2 per
group, the group top-k, a scatter for the group mask, a masked fill, the expert top-k with its radix sort,
a gather, the normalisation and the scale), each a few microseconds of a 256-wide vector plus a gap. Here
one program per token row does all of it in registers: sigmoid of the gate logits, + the correction bias
(used for the choice only), per group the sum of its two best choice scores, the topk_group best groups,
then num_experts_per_tok rounds of argmax over the experts of those groups, the chosen experts' sigmoid
scores normalised (norm_topk_prob) and scaled by routed_scaling_factor.

Ties are broken deterministically: the lower group index, then the lower expert index wins (torch.topk
leaves tie order unspecified; -0.0 ranks below +0.0 here). Each top-1 is one max reduction over int64 keys that
pack the float's order with the index (_key), one warp per token: ~10 reductions for DeepSeek-V3's grouping, 8
for GLM-5's single group (the group stage is compiled out when every group is kept). Ids come out in descending order of choice score (the reference's
topk(sorted=False) order is unspecified; moe() sums over them, so only the set and the weights matter).
NaN logits are not handled (the reference is undefined there too).

The per-token routing is a device function (route_row), which moe_fused_triton.py's gate kernel also calls after its
router GEMV. Device tensors only (no host sync), static shapes: it sits inside the decode step's CUDA graph. Under
TRITON_INTERPRET=1 it also runs on CPU tensors, which is how tests/engine/test_moe_route.py checks it
against moe.route().
"""

from __future__ import annotations

import torch

from tilepd.engine import pdl

try:
    import triton
    import triton.language as tl
    from tilepd.engine.pdl import trigger, wait
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _key(v, idx):
        """float32 v and index idx (< 2^16) -> one int64 whose order is v's, the lower idx first among equal v:
        a top-1 is one max reduction instead of a max and an argmin (the sign-magnitude bits made monotone)."""
        b = v.to(tl.int32, bitcast=True)
        ordered = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 32) | (0xFFFF - idx).to(tl.int64)

    @triton.jit
    def _key_value(k):
        ordered = (k >> 32).to(tl.int32)
        return tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _key_index(k):
        return 0xFFFF - (k & 0xFFFF)

    @triton.jit
    def route_row(row, BIAS, ids_out, wts_out, scale,  # noqa: ANN201 - a Triton device function, no Python return
                  N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                  G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr, NORMALISE: tl.constexpr, SHARED_SLOT: tl.constexpr,
                  N_SLOTS: tl.constexpr):
        """One token's routing: gate logits at `row` -> N_SLOTS ids at `ids_out`, weights at `wts_out` (in its dtype).
        The logits are read past L1 (.cg): moe_fused_triton's gate kernel routes logits other programs just wrote."""
        g = tl.arange(0, G_PAD)
        j = tl.arange(0, GS_PAD)
        valid = (g[:, None] < N_GROUP) & (j[None, :] < GROUP_SIZE)
        e = g[:, None] * GROUP_SIZE + j[None, :]  # expert index, [G_PAD, GS_PAD]
        neg = float("-inf")
        none = -9200000000000000000  # below every _key of a float (the key of -inf is about -9.187e18)
        scores = tl.sigmoid(tl.load(row + e, mask=valid, other=0.0, cache_modifier=".cg").to(tl.float32))
        choice = tl.where(valid, scores + tl.load(BIAS + e, mask=valid, other=0.0).to(tl.float32), neg)
        allowed = valid
        if TOPK_GROUP < N_GROUP:
            # per group: the sum of its two best choice scores (topk(2).sum(); a repeated best counts twice)
            best = tl.max(tl.where(valid, _key(choice, j[None, :]), none), axis=1)
            second = tl.max(tl.where(j[None, :] == _key_index(best)[:, None], neg, choice), axis=1)
            gkey = tl.where(g < N_GROUP, _key(_key_value(best) + second, g), none)
            # the TOPK_GROUP best groups, the lower index first among equals
            chosen = g < 0
            for _ in tl.static_range(TOPK_GROUP):
                pick = _key_index(tl.max(gkey, axis=0))
                hit = g == pick
                chosen = chosen | hit
                gkey = tl.where(hit, none, gkey)
            allowed = valid & chosen[:, None]
        # TOP_K rounds of top-1 over the allowed experts, the lower index first among equals
        ekey = tl.where(allowed, _key(choice, e), none)
        kk = tl.arange(0, K_PAD)
        ids = tl.zeros([K_PAD], dtype=tl.int64)
        for i in tl.static_range(TOP_K):
            pick = _key_index(tl.max(tl.max(ekey, axis=1), axis=0))
            ekey = tl.where(e == pick, none, ekey)
            ids = tl.where(kk == i, pick, ids)
        kmask = kk < TOP_K
        wts = tl.where(kmask, tl.sigmoid(tl.load(row + ids, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)), 0.0)  # the chosen scores
        if NORMALISE:
            wts = wts / (tl.sum(wts, axis=0) + 1e-20)
        wts = wts * scale
        if SHARED_SLOT:  # one more slot after the routed ones: id -1 (the shared expert), weight 1
            ids = tl.where(kk == TOP_K, -1, ids)
            wts = tl.where(kk == TOP_K, 1.0, wts)
        smask = kk < N_SLOTS
        tl.store(ids_out + kk, ids, mask=smask)
        tl.store(wts_out + kk, wts.to(wts_out.dtype.element_ty), mask=smask)

    @triton.jit
    def _route_kernel(LOGITS, BIAS, IDS, WEIGHTS, s_lt, s_it, s_wt, scale,
                      N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                      G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr, NORMALISE: tl.constexpr, SHARED_SLOT: tl.constexpr,
                      N_SLOTS: tl.constexpr, PDL: tl.constexpr = False):
        wait(PDL)  # everything it reads but the bias is the step's (pdl.py)
        t = tl.program_id(0)
        route_row(LOGITS + t * s_lt, BIAS, IDS + t * s_it, WEIGHTS + t * s_wt, scale, N_GROUP, GROUP_SIZE, TOPK_GROUP, TOP_K,
                  G_PAD, GS_PAD, K_PAD, NORMALISE, SHARED_SLOT, N_SLOTS)
        trigger(PDL)  # pdl.py: the late form triggers here

def route_constants(n_exp: int, n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool, shared_slot: bool) -> dict:
    """The routing's compile-time constants (route_row's) for n_exp experts, after refusing by name what it cannot route."""
    if n_group < 1 or n_exp % n_group:
        raise ValueError(f"MoE routing: n_group={n_group} does not divide n_routed_experts={n_exp}")
    group_size = n_exp // n_group
    if group_size < 2:
        raise ValueError(f"MoE routing: groups of {group_size} expert(s) (n_group={n_group}); the group score sums each group's top 2")
    if n_exp > 0xFFFF:
        raise ValueError(f"MoE routing: {n_exp} experts; the kernel's packed keys hold indices below 65535")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"MoE routing: topk_group={topk_group} must be in 1..n_group={n_group}")
    if not 1 <= top_k <= topk_group * group_size:
        raise ValueError(f"MoE routing: num_experts_per_tok={top_k} must be in 1..{topk_group * group_size} "
                         f"(the experts of topk_group={topk_group} groups of {group_size})")
    slots = top_k + int(shared_slot)
    return dict(N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group, TOP_K=top_k, G_PAD=max(2, triton.next_power_of_2(n_group)),
                GS_PAD=triton.next_power_of_2(group_size), K_PAD=max(2, triton.next_power_of_2(slots)), NORMALISE=bool(norm_topk_prob),
                SHARED_SLOT=bool(shared_slot), N_SLOTS=slots)


def route_logits(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, shared_slot: bool = False,
                 weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate logits [T, E] (before the sigmoid) and the correction bias [E] -> (expert ids [T, top_k] int64,
    weights [T, top_k] float32), as moe.route() computes them after its gate GEMV. shared_slot: one more column,
    id -1 with weight 1, for the shared expert run as one more row of the grouped expert GEMV; weights_dtype: the
    weights rounded once to it (the activations' dtype, which the reference multiplies in)."""
    if triton is None:
        raise RuntimeError("MoE routing kernel needs Triton, which is not importable here")
    if logits.dim() != 2 or bias.dim() != 1 or bias.shape[0] != logits.shape[1]:
        raise ValueError(f"MoE routing: logits {list(logits.shape)} and bias {list(bias.shape)} do not fit (logits [T, E], bias [E])")
    t, n_exp = logits.shape
    consts = route_constants(n_exp, n_group, topk_group, top_k, norm_topk_prob, shared_slot)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    bias = bias.contiguous()
    slots = consts["N_SLOTS"]
    ids = torch.empty(t, slots, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, slots, dtype=weights_dtype, device=logits.device)
    if t == 0:
        return ids, weights
    _route_kernel[(t,)](logits, bias, ids, weights, logits.stride(0), ids.stride(0), weights.stride(0), float(routed_scaling_factor),
                        **consts, num_warps=1, **pdl.launch_args(logits, "gate", "route"))  # one warp: every reduction is warp shuffles
    return ids, weights
