"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/3) for batch-1 decode over a static KV cache.

Weights come in tilepd's converted layout: fused `wqkv` (q, k, v rows) and `w13` (gate, up rows), so
each layer runs two fused GEMVs plus `wo` and `w2`. The cache of layer i is [max_seq_len, Hkv, 2*D]
(K then V per head), exactly KVState's engine layout, so inject is one copy per layer.

A layer is two pure functions around the cache write (`attn_in`, `attn_out_mlp`): every layer calls
the same two, so `torch.compile` (optional, GPU) compiles each once and fuses the small element-wise
ops; the cache write stays outside the compiled code so the cache is never copied.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tilepd.engine.layers import linear, linear_add, attention_bias, cached_attention, length_mask, norm_linear, rms_norm, silu_mul_linear_add
from tilepd.engine.rope import apply_rope_neox, rope_table
from tilepd.model_format.model_spec import ModelSpec


def attn_in(x: torch.Tensor, norm_w: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None, q_norm: torch.Tensor | None,
            k_norm: torch.Tensor | None, cs: torch.Tensor, eps: float, nh: int, nkv: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm, fused QKV GEMV, (QK-norm), RoPE on q and k together. Returns q [T, nh, hd] and kv [T, nkv, 2*hd]."""
    t = x.shape[0]
    qkv = norm_linear(x, norm_w, eps, wqkv, bqkv)
    qk = qkv[:, : (nh + nkv) * hd].view(t, nh + nkv, hd)
    v = qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)
    if q_norm is not None:
        qk = torch.cat([rms_norm(qk[:, :nh], q_norm, eps), rms_norm(qk[:, nh:], k_norm, eps)], dim=1)
    qk = apply_rope_neox(qk, cs)
    return qk[:, :nh], torch.cat([qk[:, nh:], v], dim=-1)


def post_attn(x: torch.Tensor, attn: torch.Tensor, wo: torch.Tensor, mlp_norm: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              eps: float) -> torch.Tensor:
    """Output projection + residual, norm, SwiGLU MLP (fused gate-up GEMV) + residual. attn [T, H, D]."""
    x = linear_add(x, attn.reshape(x.shape[0], -1).to(x.dtype), wo)
    return silu_mul_linear_add(x, norm_linear(x, mlp_norm, eps, w13), w2)


def attn_out_mlp(x: torch.Tensor, q: torch.Tensor, window: torch.Tensor, mask: torch.Tensor, wo: torch.Tensor, mlp_norm: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, scale: float, eps: float, hd: int) -> torch.Tensor:
    """Attention over the cache window, then post_attn."""
    out = cached_attention(q, window[..., :hd], window[..., hd:], mask, scale)
    return post_attn(x, out, wo, mlp_norm, w13, w2, eps)


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
        dtype = weights["embed"].dtype
        self.rope = rope_table(spec.head_dim, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, max_seq_len, device, dtype)
        self.lm_head = weights["embed"] if spec.tie_word_embeddings else weights["lm_head"]
        self.scale = spec.head_dim**-0.5
        self.layer_weights = [
            tuple(weights.get(f"layers.{i}.{n}") for n in ("attn_norm", "wqkv", "bqkv", "q_norm", "k_norm", "wo", "mlp_norm", "w13", "w2"))
            for i in range(spec.num_layers)
        ]
        self.attn_in: Callable = attn_in
        self.attn_out_mlp: Callable = attn_out_mlp
        self.post_attn: Callable | None = None  # set: attention runs uncompiled between two compiled halves

    def compile(self, mode: str | None = None, include_attention: bool = True, options: dict[str, object] | None = None) -> None:
        """torch.compile the per-layer functions (each compiled once, reused by every layer); `options` (Inductor's,
        e.g. compiled.SPEED_COMPILE_OPTIONS) go instead of a `mode`, torch.compile takes one or the other.

        include_attention=False keeps the cache-reading attention out of the compiled code, in case the
        compiler would copy the strided cache window before its batched GEMV."""
        kw: dict[str, object] = {"options": options} if options is not None else {"mode": mode}
        self.attn_in = torch.compile(attn_in, dynamic=False, **kw)
        if include_attention:
            self.attn_out_mlp = torch.compile(attn_out_mlp, dynamic=False, **kw)
        else:
            self.post_attn = torch.compile(post_attn, dynamic=False, **kw)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [T] long on device; attn_len: static cache window (> max position).

        Returns (logits [T, V] float32, final hidden [T, hidden])."""
        s = self.spec
        eps, nh, nkv, hd = s.rms_norm_eps, s.num_heads, s.num_kv_heads, s.head_dim
        x = F.embedding(tokens, self.w["embed"])
        cs = self.rope.index_select(0, positions)
        mask = attention_bias(length_mask(positions, attn_len), nh // nkv, x.dtype)
        for cache, (an, wqkv, bqkv, qn, kn, wo, mn, w13, w2) in zip(self.caches, self.layer_weights):
            q, kv = self.attn_in(x, an, wqkv, bqkv, qn, kn, cs, eps, nh, nkv, hd)
            cache.index_copy_(0, positions, kv.to(cache.dtype))
            window = cache[:attn_len]
            if self.post_attn is None:
                x = self.attn_out_mlp(x, q, window, mask, wo, mn, w13, w2, self.scale, eps, hd)
            else:
                out = cached_attention(q, window[..., :hd], window[..., hd:], mask, self.scale)
                x = self.post_attn(x, out, wo, mn, w13, w2, eps)
        h = rms_norm(x, self.w["norm"], eps)
        return linear(h, self.lm_head).float(), h
