"""DeepSeek-V3-family decoder (DeepSeek-V3.x, GLM-5 style): MLA with the latent cache, MoE, MTP draft layer.

Attention is the absorbed-weight form for decode: the cache holds only the normalised latent c (rank r)
and the roped shared key k_pe per token. W_UK is folded into the query (q_lat = q_nope @ W_UK), scores are
q_lat.c + q_pe.k_pe, and W_UV is applied to the attention-weighted latent afterwards, so no per-head K/V
is ever materialised and each step reads (r + rope) values per cached token.

DSA models (deepseek_v32, glm_moe_dsa) add the lightning indexer (dsa.py): per layer an indexer-key cache,
and attention over the indexer's top-k positions only; GLM "shared" layers reuse the previous full
layer's top-k (transformers modeling_glm_moe_dsa.py:404-417), MTP layers always index for themselves.

On CUDA with layers.ATTENTION_IMPL["mla"] == "triton" (compiled.accelerate sets it) the latent attention,
dense and sparse, runs in mla_attention.py's kernel, which reads each cache row once for K and V and
needs no [H*T, L] bias: dense layers then get a DenseSpan (each token's visible slots) instead. The same
switch puts DSA's indexer on its kernels (dsa_indexer.py: key norm + RoPE + cache write, scores; dsa_topk.py:
the top-k as a radix select).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tilepd.engine.dsa import DSAStep, select_topk, sparse_mla_attention
from tilepd.engine import mla_fused
from tilepd.engine.mla_fused import DenseSpan
from tilepd.engine.layers import ATTENTION_IMPL, linear, attention_bias, cached_attention, length_mask, rms_norm
from tilepd.engine.moe import mlp_block
from tilepd.engine.rope import apply_rope_interleaved, apply_rope_neox, rope_table, yarn_softmax_scale
from tilepd.model_format.model_spec import ModelSpec


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
        self._zero = torch.zeros(1, dtype=torch.long, device=device)  # main layers see slots from 0
        self.rope = rope_table(spec.qk_rope_head_dim, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, max_seq_len,
                               device, weights["embed"].dtype, interleaved=spec.rope_interleave)
        self.scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5 * yarn_softmax_scale(spec.rope_scaling)
        self._rope_fn = apply_rope_interleaved if spec.rope_interleave else apply_rope_neox
        self.fused: dict[str, mla_fused.FusedLayer] = {}  # the speed path's concatenated projections (mla_fused.prepare_model)
        # DSA: indexer-key caches keyed by layer prefix (none for GLM "shared" layers), cache dtype.
        self.index_caches: dict[str, torch.Tensor] = {}
        if spec.is_dsa:
            n_mtp = len(self.mtp_caches)
            for i, p in [(i, f"layers.{i}.") for i in range(spec.num_layers)] + [(spec.num_layers + k, f"mtp.{k}.") for k in range(n_mtp)]:
                if spec.has_indexer(i):
                    self.index_caches[p] = torch.zeros(max_seq_len, spec.index_head_dim, dtype=cache_dtype, device=device)
                    self.w[p + "idx_weights_proj"] = self.w[p + "idx_weights_proj"].float()  # HF keeps it fp32
            self.index_rope = self.rope if spec.indexer_rope_interleave == spec.rope_interleave else rope_table(
                spec.qk_rope_head_dim, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, max_seq_len, device,
                weights["embed"].dtype, interleaved=spec.indexer_rope_interleave)
            self._index_rope_fn = apply_rope_interleaved if spec.indexer_rope_interleave else apply_rope_neox

    def index_cache_list(self) -> list[torch.Tensor | None]:
        """Indexer-key cache per layer in KVState order (main layers, then MTP); None where a layer has none."""
        prefixes = [f"layers.{i}." for i in range(self.spec.num_layers)] + [f"mtp.{k}." for k in range(len(self.mtp_caches))]
        return [self.index_caches.get(p) for p in prefixes]

    def _mla_kernel(self, x: torch.Tensor) -> bool:
        """Whether this step's latent attention runs in the Triton kernel (CUDA speed path, supported widths;
        on CPU only under Triton's interpreter, TRITON_INTERPRET=1, which is how the CPU tests run it)."""
        if ATTENTION_IMPL["mla"] != "triton" or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            return False
        from tilepd.engine.mla_attention import supports

        return supports(self.spec.kv_lora_rank, self.spec.qk_rope_head_dim)

    def _dense_mask(self, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, lo: torch.Tensor) -> torch.Tensor | DenseSpan:
        """The kernel's span (lo..position) or, on the reference path, the additive bias of `valid`."""
        if self._mla_kernel(x):
            return DenseSpan(lo.expand(positions.shape[0]).contiguous(), positions, valid.shape[1])
        return attention_bias(valid, self.spec.num_heads, x.dtype)

    def _span_or_bias(self, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, lo: torch.Tensor,
                      dsa: DSAStep | None) -> torch.Tensor | DenseSpan | None:
        """The step's dense mask. DSA attends through dsa.selection, but on the kernel path it gets the span too: while
        the window fits index_topk the selection is every slot of that span, and mla_fused reads it as a span."""
        if dsa is not None and not self._mla_kernel(x):
            return None
        return self._dense_mask(x, positions, valid, lo)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings (tensor parallelism overrides this with a vocab-parallel lookup)."""
        return F.embedding(tokens, self.w["embed"])

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[T, V] float32 logits (tensor parallelism overrides this with a vocab-parallel head)."""
        return linear(h, self.w["lm_head"]).float()

    def _attention(self, p: str, cache: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, cs: torch.Tensor,
                   mask: torch.Tensor | DenseSpan | None, dsa: DSAStep | None = None) -> torch.Tensor:
        s, w = self.spec, self.w
        t, r = x.shape[0], s.kv_lora_rank
        if s.q_lora_rank:
            q_resid = rms_norm(linear(x, w[p + "wq_a"]), w[p + "q_a_norm"], s.rms_norm_eps)
            q = linear(q_resid, w[p + "wq_b"])
        else:
            q = linear(x, w[p + "wq"])
        q_nope, q_pe = q.view(t, s.num_heads, -1).split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        q_pe = self._rope_fn(q_pe, cs)
        latent, k_pe = linear(x, w[p + "wkv_a"]).split([r, s.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, w[p + "kv_a_norm"], s.rms_norm_eps)
        k_pe = self._rope_fn(k_pe.view(t, 1, -1), cs)
        cache.index_copy_(0, positions, torch.cat([latent.view(t, 1, r), k_pe], dim=-1).to(cache.dtype))
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w[p + "w_uk"])  # W_UK absorbed into the query
        if dsa is not None:
            keys = self.index_caches.get(p)
            if keys is not None:  # a full layer indexes; a shared one reuses the previous full layer's top-k
                idx_cs = cs if self.index_rope is self.rope else self.index_rope.index_select(0, positions)
                dsa.selection = select_topk(w, p, x, q_resid, positions, idx_cs, keys, dsa.valid, s, self._index_rope_fn,
                                            kernels=self._mla_kernel(x))
            q_cat, sel = torch.cat([q_lat, q_pe], dim=-1), dsa.selection
            if self._mla_kernel(x):
                from tilepd.engine.mla_attention import mla_sparse_attention

                out_lat = mla_sparse_attention(q_cat, cache, r, sel.idx, sel.ok, self.scale)
            else:
                out_lat = sparse_mla_attention(q_cat, cache, r, sel, self.scale)
        elif isinstance(mask, DenseSpan):
            from tilepd.engine.mla_attention import mla_dense_attention

            out_lat = mla_dense_attention(torch.cat([q_lat, q_pe], dim=-1), cache, r, mask.lo, mask.hi, mask.length, self.scale)
        else:
            window = cache[: mask.shape[1]]
            out_lat = cached_attention(torch.cat([q_lat, q_pe], dim=-1), window, window[..., :r], mask, self.scale)
        out = torch.einsum("thc,hvc->thv", out_lat.to(x.dtype), w[p + "w_uv"])  # W_UV after attention
        return linear(out.reshape(t, -1), w[p + "wo"])

    def _attention_residual(self, p: str, cache: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, cs: torch.Tensor,
                            mask: torch.Tensor | DenseSpan | None, dsa: DSAStep | None) -> torch.Tensor:
        """x + attention(rms_norm(x)): on the speed path in a few fused launches (mla_fused), else the ops above."""
        if mla_fused.applies(self, p, x):
            return mla_fused.attention_block(self, p, cache, x, positions, cs, mask, dsa)
        return x + self._attention(p, cache, rms_norm(x, self.w[p + "attn_norm"], self.spec.rms_norm_eps), positions, cs, mask, dsa=dsa)

    def _layer(self, p: str, cache: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, cs: torch.Tensor, mask: torch.Tensor | DenseSpan | None, is_moe: bool,
               dsa: DSAStep | None = None) -> torch.Tensor:
        s, w = self.spec, self.w
        x = self._attention_residual(p, cache, x, positions, cs, mask, dsa)
        return mlp_block(x, w, p, s, is_moe)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Main model on T tokens. Returns (logits [T, V] float32, final-normed hidden [T, h])."""
        s, w = self.spec, self.w
        x = self._embed(tokens)
        cs = self.rope.index_select(0, positions)
        valid = length_mask(positions, attn_len)
        dsa = DSAStep(valid) if s.is_dsa else None
        mask = self._span_or_bias(x, positions, valid, self._zero, dsa)
        for i in range(s.num_layers):
            x = self._layer(f"layers.{i}.", self.caches[i], x, positions, cs, mask, i >= s.first_k_dense_replace, dsa=dsa)
        h = rms_norm(x, w["norm"], s.rms_norm_eps)
        return self._logits(h), h

    def mtp_forward(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor, attn_len: int, k: int = 0,
                    head_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP module k: embedding of token t_{i+1} with the hidden state of position i -> logits for t_{i+2}.

        Follows vLLM's convention: the module runs at position i (the position of prev_hidden). head_rows (device
        indices): logits of those rows only (the speculative step drafts from one row of its k+1; the head is
        the largest weight the draft reads); the hidden states are always all rows'."""
        s, w, p = self.spec, self.w, f"mtp.{k}."
        e = rms_norm(self._embed(tokens), w[p + "enorm"], s.rms_norm_eps)
        hp = rms_norm(prev_hidden, w[p + "hnorm"], s.rms_norm_eps)
        x = linear(torch.cat([e, hp], dim=-1), w[p + "eh_proj"])
        cs = self.rope.index_select(0, positions)
        valid = length_mask(positions, attn_len) & (torch.arange(attn_len, device=positions.device) >= self.mtp_start)[None, :]
        dsa = DSAStep(valid) if s.is_dsa else None
        mask = self._span_or_bias(x, positions, valid, self.mtp_start, dsa)
        x = self._layer(p, self.mtp_caches[k], x, positions, cs, mask, True, dsa=dsa)
        h = rms_norm(x, w[p + "head_norm"], s.rms_norm_eps)
        return self._logits(h if head_rows is None else h.index_select(0, head_rows)), h
