"""DeepSeek-V3-family decoder (DeepSeek-V3.x, GLM-5 style): MLA with the latent cache, MoE, MTP draft layer.

Attention is the absorbed-weight form for decode: the cache holds only the normalised latent c (rank r)
and the roped shared key k_pe per token. W_UK is folded into the query (q_lat = q_nope @ W_UK), scores are
q_lat.c + q_pe.k_pe, and W_UV is applied to the attention-weighted latent afterwards, so no per-head K/V
is ever materialised and each step reads (r + rope) values per cached token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilepd.engine.layers import linear, attention_bias, cached_attention, length_mask, rms_norm, swiglu
from tilepd.engine.moe import moe
from tilepd.engine.rope import apply_rope_interleaved, apply_rope_neox, rope_table, yarn_softmax_scale
from tilepd.engine.spec import ModelSpec


class DeepseekV3Model:
    """Device weights, latent caches (main layers + MTP layers) and the RoPE table."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_seq_len: int, device: torch.device, cache_dtype: torch.dtype) -> None:
        self.spec = spec
        self.w = weights
        self.max_seq_len = max_seq_len
        width = spec.kv_lora_rank + spec.qk_rope_head_dim
        self.caches = [torch.zeros(max_seq_len, 1, width, dtype=cache_dtype, device=device) for _ in range(spec.num_layers)]
        self.has_mtp = spec.num_mtp_layers > 0 and "mtp.0.eh_proj" in weights
        self.mtp_caches = [torch.zeros(max_seq_len, 1, width, dtype=cache_dtype, device=device) for _ in range(spec.num_mtp_layers if self.has_mtp else 0)]
        # The MTP layer only has KV for positions it processed itself (the prefill did not run it).
        self.mtp_start = torch.zeros(1, dtype=torch.long, device=device)
        self.rope = rope_table(spec.qk_rope_head_dim, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, max_seq_len,
                               device, weights["embed"].dtype, interleaved=spec.rope_interleave)
        self.scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5 * yarn_softmax_scale(spec.rope_scaling)
        self._rope_fn = apply_rope_interleaved if spec.rope_interleave else apply_rope_neox

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings (tensor parallelism overrides this with a vocab-parallel lookup)."""
        return F.embedding(tokens, self.w["embed"])

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[T, V] float32 logits (tensor parallelism overrides this with a vocab-parallel head)."""
        return linear(h, self.w["lm_head"]).float()

    def _attention(self, p: str, cache: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, cs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s, w = self.spec, self.w
        t, r = x.shape[0], s.kv_lora_rank
        if s.q_lora_rank:
            q = linear(rms_norm(linear(x, w[p + "wq_a"]), w[p + "q_a_norm"], s.rms_norm_eps), w[p + "wq_b"])
        else:
            q = linear(x, w[p + "wq"])
        q_nope, q_pe = q.view(t, s.num_heads, -1).split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        q_pe = self._rope_fn(q_pe, cs)
        latent, k_pe = linear(x, w[p + "wkv_a"]).split([r, s.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, w[p + "kv_a_norm"], s.rms_norm_eps)
        k_pe = self._rope_fn(k_pe.view(t, 1, -1), cs)
        cache.index_copy_(0, positions, torch.cat([latent.view(t, 1, r), k_pe], dim=-1).to(cache.dtype))
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w[p + "w_uk"])  # W_UK absorbed into the query
        window = cache[: mask.shape[1]]
        out_lat = cached_attention(torch.cat([q_lat, q_pe], dim=-1), window, window[..., :r], mask, self.scale)
        out = torch.einsum("thc,hvc->thv", out_lat.to(x.dtype), w[p + "w_uv"])  # W_UV after attention
        return linear(out.reshape(t, -1), w[p + "wo"])

    def _layer(self, p: str, cache: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, cs: torch.Tensor, mask: torch.Tensor, is_moe: bool) -> torch.Tensor:
        s, w = self.spec, self.w
        x = x + self._attention(p, cache, rms_norm(x, w[p + "attn_norm"], s.rms_norm_eps), positions, cs, mask)
        h = rms_norm(x, w[p + "mlp_norm"], s.rms_norm_eps)
        return x + (moe(h, w, p, s) if is_moe else swiglu(h, w[p + "w13"], w[p + "w2"]))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Main model on T tokens. Returns (logits [T, V] float32, final-normed hidden [T, h])."""
        s, w = self.spec, self.w
        x = self._embed(tokens)
        cs = self.rope.index_select(0, positions)
        mask = attention_bias(length_mask(positions, attn_len), s.num_heads, x.dtype)
        for i in range(s.num_layers):
            x = self._layer(f"layers.{i}.", self.caches[i], x, positions, cs, mask, i >= s.first_k_dense_replace)
        h = rms_norm(x, w["norm"], s.rms_norm_eps)
        return self._logits(h), h

    def mtp_forward(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor, attn_len: int, k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP module k: embedding of token t_{i+1} with the hidden state of position i -> logits for t_{i+2}.

        Follows vLLM's convention: the module runs at position i (the position of prev_hidden)."""
        s, w, p = self.spec, self.w, f"mtp.{k}."
        e = rms_norm(self._embed(tokens), w[p + "enorm"], s.rms_norm_eps)
        hp = rms_norm(prev_hidden, w[p + "hnorm"], s.rms_norm_eps)
        x = linear(torch.cat([e, hp], dim=-1), w[p + "eh_proj"])
        cs = self.rope.index_select(0, positions)
        mask = length_mask(positions, attn_len)
        mask = attention_bias(mask & (torch.arange(attn_len, device=positions.device) >= self.mtp_start)[None, :], s.num_heads, x.dtype)
        x = self._layer(p, self.mtp_caches[k], x, positions, cs, mask, True)
        h = rms_norm(x, w[p + "head_norm"], s.rms_norm_eps)
        return self._logits(h), h
