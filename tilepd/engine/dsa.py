"""DeepSeek Sparse Attention (DSA) for the decode step: the lightning indexer and MLA over its top-k.

Models: deepseek_v32 and glm_moe_dsa. Per layer with an indexer (GLM "shared" layers have none and reuse
the previous full layer's selection), each new token
  1. computes its indexer key k = LayerNorm(wk . h) (with bias, eps 1e-6), ropes k[:rope] and writes k into
     the layer's indexer-key cache [max_seq_len, index_head_dim];
  2. scores every cached position l: sum_h w_h * relu(q_h . k_l * d^-0.5), w = weights_proj(h) in fp32 times
     n_heads^-0.5, q = wq_b . q_resid with q[:rope] roped (transformers modeling_glm_moe_dsa.py:211-242,
     modeling_deepseek_v32.py same lines; vLLM deepseek_v2.py:763-852 folds the same scales into `weights`);
  3. keeps the index_topk best causal positions (all of them while the context is shorter);
  4. runs MLA attention over those positions only.

Static shapes throughout (CUDA-graph safe): the scores span the whole cache window [T, L] with
invalid slots at -inf, top-k takes a fixed k = min(index_topk, L), and selected slots that are not
valid (possible only while the context is shorter than k) are masked in the attention. No host sync.

Cache layout, as vLLM's prefill writes it (INTERFACES §1): the roped part first, then the rest; RoPE
applied GPT-J style (pairs interleaved) when `indexer_rope_interleave` is true (GLM), NeoX half-split
otherwise (DeepSeek-V3.2). transformers' GLM cache holds the same values with the roped pairs
de-interleaved ([evens | odds]); the dot products are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tilepd.engine.layers import linear
from tilepd.model_format.model_spec import ModelSpec

RopeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Selection:
    """Top-k positions per query token: idx [T, K] (cache slots) and ok [T, K] (slot is causal and filled)."""

    idx: torch.Tensor
    ok: torch.Tensor


@dataclass
class DSAStep:
    """Per-forward DSA state: which cache slots each query may see, and the last full layer's selection."""

    valid: torch.Tensor  # [T, L] bool
    selection: Selection | None = None


def _rope_head(x: torch.Tensor, cs: torch.Tensor, rope_dim: int, rope_fn: RopeFn) -> torch.Tensor:
    """RoPE on the first rope_dim channels of x [T, H, D] (the indexer's layout: roped part first)."""
    return torch.cat([rope_fn(x[..., :rope_dim].contiguous(), cs), x[..., rope_dim:]], dim=-1)


def indexer_key(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, cs: torch.Tensor, spec: ModelSpec, rope_fn: RopeFn) -> torch.Tensor:
    """[T, index_head_dim] indexer keys of the tokens x (the attention's normed input)."""
    d = spec.index_head_dim
    k = F.layer_norm(linear(x, w[p + "idx_wk"]), (d,), w[p + "idx_k_norm"], w[p + "idx_k_norm_bias"], 1e-6)
    return _rope_head(k.view(-1, 1, d), cs, spec.qk_rope_head_dim, rope_fn).view(-1, d)


def select_topk(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
                cs: torch.Tensor, keys_cache: torch.Tensor, valid: torch.Tensor, spec: ModelSpec, rope_fn: RopeFn,
                kernels: bool = False) -> Selection:
    """Write the new tokens' indexer keys at `positions`, score the window [0, L) and keep the top index_topk.

    kernels: through dsa_indexer.py and dsa_topk.py (the speed path: the GEMVs plus six launches,
    no torch topk); otherwise the portable torch ops below, which are the kernels' reference."""
    if kernels:
        return _select_topk_kernels(w, p, x, q_resid, positions, cs, keys_cache, valid, spec)
    t, nh, d = x.shape[0], spec.index_n_heads, spec.index_head_dim
    keys_cache.index_copy_(0, positions, indexer_key(w, p, x, cs, spec, rope_fn).to(keys_cache.dtype))
    q = _rope_head(linear(q_resid, w[p + "idx_wq_b"]).view(t, nh, d), cs, spec.qk_rope_head_dim, rope_fn)
    keys = keys_cache[: valid.shape[1]]
    # Same order of operations as transformers (modeling_glm_moe_dsa.py:228-233): scale, relu, then the
    # fp32 head weights (weights_proj on fp32 input) times n_heads^-0.5, summed over heads. The q.k products
    # read the keys in the cache dtype (fp32 accumulation; no fp32 copy of a long window per step): exact in
    # fp32, and in bf16 still finer than vLLM's own fp8 scoring.
    scores = F.relu(torch.matmul(q.to(keys.dtype), keys.t()).float() * d**-0.5)  # [T, H, L]
    weights = linear(x.float(), w[p + "idx_weights_proj"]) * nh**-0.5  # [T, H]
    index = torch.matmul(weights.unsqueeze(1), scores).squeeze(1)  # [T, L]
    index = index.masked_fill(~valid, float("-inf"))
    k = min(spec.index_topk, valid.shape[1])
    idx = index.topk(k, dim=-1).indices
    return Selection(idx, valid.gather(1, idx))


def _select_topk_kernels(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
                         cs: torch.Tensor, keys_cache: torch.Tensor, valid: torch.Tensor, spec: ModelSpec) -> Selection:
    from tilepd.engine.dsa_indexer import index_topk, write_index_keys

    t, nh, d, rope = x.shape[0], spec.index_n_heads, spec.index_head_dim, spec.qk_rope_head_dim
    write_index_keys(linear(x, w[p + "idx_wk"]), w[p + "idx_k_norm"], w[p + "idx_k_norm_bias"], cs, positions, keys_cache,
                     rope, spec.indexer_rope_interleave)
    q = linear(q_resid, w[p + "idx_wq_b"]).view(t, nh, d)
    weights = linear(x.float(), w[p + "idx_weights_proj"])  # [T, H] fp32; n_heads^-0.5 is applied in the kernel
    return Selection(*index_topk(q, cs, weights, keys_cache, valid, rope, spec.indexer_rope_interleave,
                                 min(spec.index_topk, valid.shape[1])))


def sparse_mla_attention(q: torch.Tensor, cache: torch.Tensor, rank: int, sel: Selection, scale: float) -> torch.Tensor:
    """MLA (absorbed form) over each query's selected slots only.

    q [T, H, rank + rope] (q_lat | q_pe); cache [max_seq_len, 1, rank + rope]. Returns the attention-weighted
    latent [T, H, rank]. Gathers K = index_topk rows per query, so a step reads index_topk latents whatever
    the context length."""
    t, k = sel.idx.shape
    kv = cache[:, 0].index_select(0, sel.idx.reshape(-1)).view(t, k, -1)  # [T, K, W]
    scores = torch.matmul(q.to(kv.dtype), kv.transpose(1, 2)).float() * scale  # [T, H, K]
    scores = scores.masked_fill(~sel.ok[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(kv.dtype)
    return torch.matmul(probs, kv[..., :rank])
