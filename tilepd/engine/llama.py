"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/3) for batch-1 decode over a static KV cache.

Weights come in tilepd's converted layout: fused `wqkv` (q, k, v rows) and `w13` (gate, up rows), so
each layer runs two fused GEMVs plus `wo` and `w2`. The cache of layer i is [max_seq_len, Hkv, 2*D]
(K then V per head), exactly the native KVState layout, so inject is one copy per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilepd.engine.layers import cached_attention, length_mask, rms_norm, swiglu
from tilepd.engine.rope import apply_rope_neox, rope_table
from tilepd.engine.spec import ModelSpec


class LlamaModel:
    """Holds device weights, the static cache and the RoPE table; `forward` runs T tokens at given positions."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_seq_len: int, device: torch.device, cache_dtype: torch.dtype) -> None:
        self.spec = spec
        self.w = weights
        self.max_seq_len = max_seq_len
        self.caches = [
            torch.zeros(max_seq_len, spec.num_kv_heads, 2 * spec.head_dim, dtype=cache_dtype, device=device)
            for _ in range(spec.num_layers)
        ]
        self.rope = rope_table(spec.head_dim, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, max_seq_len, device)
        self.lm_head = weights["embed"] if spec.tie_word_embeddings else weights["lm_head"]
        self.scale = spec.head_dim**-0.5
        self._split = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim)

    def _attention(self, i: int, x: torch.Tensor, positions: torch.Tensor, cs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s, w, p = self.spec, self.w, f"layers.{i}."
        t = x.shape[0]
        qkv = F.linear(x, w[p + "wqkv"], w.get(p + "bqkv"))
        q, k, v = qkv.split(self._split, dim=-1)
        q = q.view(t, s.num_heads, s.head_dim)
        k = k.view(t, s.num_kv_heads, s.head_dim)
        v = v.view(t, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = rms_norm(q, w[p + "q_norm"], s.rms_norm_eps)
            k = rms_norm(k, w[p + "k_norm"], s.rms_norm_eps)
        q, k = apply_rope_neox(q, cs), apply_rope_neox(k, cs)
        cache = self.caches[i]
        cache.index_copy_(0, positions, torch.cat([k, v], dim=-1).to(cache.dtype))
        window = cache[: mask.shape[1]]
        out = cached_attention(q, window[..., : s.head_dim], window[..., s.head_dim :], mask, self.scale)
        return F.linear(out.reshape(t, -1).to(x.dtype), w[p + "wo"])

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [T] long on device; attn_len: static cache window (> max position).

        Returns (logits [T, V] float32, final hidden [T, hidden])."""
        s, w = self.spec, self.w
        x = F.embedding(tokens, w["embed"])
        cs = self.rope.index_select(0, positions)
        mask = length_mask(positions, attn_len)
        for i in range(s.num_layers):
            p = f"layers.{i}."
            x = x + self._attention(i, rms_norm(x, w[p + "attn_norm"], s.rms_norm_eps), positions, cs, mask)
            x = x + swiglu(rms_norm(x, w[p + "mlp_norm"], s.rms_norm_eps), w[p + "w13"], w[p + "w2"])
        h = rms_norm(x, w["norm"], s.rms_norm_eps)
        return F.linear(h, self.lm_head).float(), h
