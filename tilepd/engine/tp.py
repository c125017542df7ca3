"""Tensor-parallel execution of one rank: the process group, vocab-parallel embedding/head, and TP models.

Megatron-style split, matching the shards `convert-weights --tp N` writes (tilepd/weights/out_tensors.py):

- attention: the fused QKV (llama) / q_b and W_UK/W_UV (MLA) are column-parallel by head, so each rank
  runs its own heads over its own cache; o_proj is row-parallel and followed by one all-reduce.
- dense MLP and shared experts: gate-up column-parallel, down row-parallel, one all-reduce.
- MoE: **TP within experts**, not expert parallel. At batch 1 a token picks top-k of E experts; with
  expert parallelism the k picks land unevenly on the ranks (often 2-3 on one rank, none on others), so a
  step takes as long as the busiest rank's weight read. Splitting every expert's intermediate dimension
  makes each rank read exactly 1/N of every selected expert: balanced bandwidth, no all-to-all, and the
  routed and shared outputs share the layer's one all-reduce. Routing (gate replicated, logits float32) sees the
  same hidden state on every rank, so every rank picks the same experts. EP pays off at large batches,
  which this batch-1 engine does not run.
- vocab: the embedding and lm_head are **vocab-parallel** (rows split, as convert-weights writes them).
  A replicated head would cost every rank the full V x hidden read each step (DeepSeek-V3: 1.85 GB bf16,
  +20% on a rank's ~9 GB per-step read at TP 8) and that much memory; vocab-parallel reads 1/N and pays one
  all-gather of V/N float32 logits per rank (~64 KiB at TP 8 for V=129k), which is far cheaper. The lookup
  masks foreign ids and all-reduces (one extra small all-reduce per step).
- MLA's latent cache is replicated: every rank holds the full [seq, 1, r + rope] latent, because every head
  reads all of it. Standard attention's cache holds only the rank's KV heads.

Every rank ends a step with identical logits (all-gathered in rank order), so greedy picks the same token
everywhere; sampled decodes get the same seed on every rank from the driver (tp_engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tilepd.engine.deepseek_v3 import DeepseekV3Model
from tilepd.engine import mla_fused, pdl
from tilepd.engine.layers import linear, attention_bias, cached_attention, length_mask, rms_norm, swiglu
from tilepd.engine.llama import LlamaModel
from tilepd.engine.moe import moe, use_fused_block
from tilepd.model_format.model_spec import ModelSpec


@dataclass
class TPGroup:
    """This process's rank in the tensor-parallel group; `group` runs the collectives (NCCL or gloo),
    `ctrl` the driver's control messages (always gloo: host objects and flags)."""

    rank: int
    size: int
    group: object | None = None
    ctrl: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial results, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' [..., n] pieces along the last dim, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass
class NoCollectiveGroup(TPGroup):
    """Rank `rank` of `size` with no other ranks: every collective returns what the real one's shape would be
    without communicating, so one rank's shard runs (and is timed) alone on one device (bench/tp_shard_step.py).
    The values are not the model's (partial sums stay unsummed, the other ranks' logits are this rank's
    repeated): never for serving."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum as it is (the real one would add the others' in place)."""
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] -> [..., size * n]: this rank's piece repeated in the other ranks' slots (one copy, as the
        real gather's concatenation costs)."""
        return x.repeat(*([1] * (x.dim() - 1)), self.size)


def check_divisible(spec: ModelSpec, tp: int) -> None:
    """Refuse a TP size the model's shapes cannot split evenly (the message names the field)."""
    fields = {"num_attention_heads": spec.num_heads, "vocab_size": spec.vocab_size, "intermediate_size": spec.intermediate_size}
    if spec.family == "llama":
        fields["num_key_value_heads"] = spec.num_kv_heads
    else:
        fields["moe_intermediate_size"] = spec.moe_intermediate_size
    bad = [f"{k}={v}" for k, v in fields.items() if v and v % tp]
    if bad:
        raise ValueError(f"tensor parallel size {tp} does not divide {', '.join(bad)} of this {spec.family} model")


def local_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The shapes one rank computes with: its share of the heads (MLA keeps the one latent 'head')."""
    check_divisible(spec, tp)
    if spec.family == "llama":
        return replace(spec, num_heads=spec.num_heads // tp, num_kv_heads=spec.num_kv_heads // tp)
    return replace(spec, num_heads=spec.num_heads // tp)


def vocab_parallel_embed(tokens: torch.Tensor, table: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Rows [rank*n, (rank+1)*n) of the embedding live here: look up ours, zero the rest, all-reduce."""
    if tp.size == 1:
        return F.embedding(tokens, table)
    n = table.shape[0]
    local = tokens - tp.rank * n
    inside = (local >= 0) & (local < n)
    x = F.embedding(local.clamp(0, n - 1), table) * inside.unsqueeze(-1).to(table.dtype)
    return tp.all_reduce(x)


class TPLlamaModel(LlamaModel):
    """LlamaModel over this rank's heads and MLP columns; an all-reduce after o_proj and after down_proj."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_seq_len: int, device: torch.device,
                 cache_dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__(spec, weights, max_seq_len, device, cache_dtype)
        self.tp = tp

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, tp = self.spec, self.tp
        eps, nh, nkv, hd = s.rms_norm_eps, s.num_heads, s.num_kv_heads, s.head_dim
        x = vocab_parallel_embed(tokens, self.w["embed"], tp)
        cs = self.rope.index_select(0, positions)
        mask = attention_bias(length_mask(positions, attn_len), nh // nkv, x.dtype)
        for cache, (an, wqkv, bqkv, qn, kn, wo, mn, w13, w2) in zip(self.caches, self.layer_weights):
            q, kv = self.attn_in(x, an, wqkv, bqkv, qn, kn, cs, eps, nh, nkv, hd)
            cache.index_copy_(0, positions, kv.to(cache.dtype))
            window = cache[:attn_len]
            out = cached_attention(q, window[..., :hd], window[..., hd:], mask, self.scale)
            x = x + tp.all_reduce(linear(out.reshape(x.shape[0], -1).to(x.dtype), wo))
            x = x + tp.all_reduce(swiglu(rms_norm(x, mn, eps), w13, w2))
        h = rms_norm(x, self.w["norm"], eps)
        return tp.all_gather_last(linear(h, self.lm_head).float()), h


class TPDeepseekV3Model(DeepseekV3Model):
    """DeepseekV3Model over this rank's MLA heads, MLP columns and expert slices (TP within experts)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_seq_len: int, device: torch.device,
                 cache_dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__(spec, weights, max_seq_len, device, cache_dtype)
        self.tp = tp

    @property
    def adds_residual(self) -> bool:
        """Whether this rank's fused blocks add the residual stream in their last kernel's epilogue: rank 0 only, so the
        all-reduce's sum is x + the ranks' partials with no add launch of its own (two launches and their gaps a layer
        fewer than `x + all_reduce(partial)`; the sum's bf16 rounding order differs from that one's, as any all-reduce's
        does from one order to another)."""
        return self.tp.rank == 0

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The base step in PDL's shard form (pdl.shard_form) on a rank of more than one: a rank's step is
        launch-bound, and the graphs captured here keep the form."""
        with pdl.shard_form(self.tp.size > 1):
            return super().forward(tokens, positions, attn_len)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(tokens, self.w["embed"], self.tp)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(super()._logits(h))

    def _attention(self, p, cache, x, positions, cs, mask, dsa=None) -> torch.Tensor:  # noqa: ANN001 - same as the base
        return self.tp.all_reduce(super()._attention(p, cache, x, positions, cs, mask, dsa=dsa))

    def _attention_residual(self, p, cache, x, positions, cs, mask, dsa) -> torch.Tensor:  # noqa: ANN001 - same as the base
        if mla_fused.applies(self, p, x):  # this rank's heads' output, the residual folded into rank 0's, all-reduced
            return self.tp.all_reduce(mla_fused.attention_block(self, p, cache, x, positions, cs, mask, dsa, residual=self.adds_residual))
        return super()._attention_residual(p, cache, x, positions, cs, mask, dsa)

    def _layer(self, p, cache, x, positions, cs, mask, is_moe, dsa=None) -> torch.Tensor:  # noqa: ANN001 - same as the base
        s, w = self.spec, self.w
        x = self._attention_residual(p, cache, x, positions, cs, mask, dsa)
        if is_moe and use_fused_block(x, w, p, s):  # this rank's expert slices in 4 launches, the residual as above
            from tilepd.engine.moe_fused import moe_block

            return self.tp.all_reduce(moe_block(x, w, p, s, residual=self.adds_residual))
        h = rms_norm(x, w[p + "mlp_norm"], s.rms_norm_eps)
        return x + self.tp.all_reduce(moe(h, w, p, s) if is_moe else swiglu(h, w[p + "w13"], w[p + "w2"]))


def build_tp_model(spec: ModelSpec, weights: dict[str, torch.Tensor], max_seq_len: int, device: torch.device,
                   cache_dtype: torch.dtype, tp: TPGroup):
    """The rank-local model for the family (its spec has the rank's head counts)."""
    ls = local_spec(spec, tp.size)
    if spec.family == "llama":
        return TPLlamaModel(ls, weights, max_seq_len, device, cache_dtype, tp)
    if spec.family == "deepseek_v3":
        return TPDeepseekV3Model(ls, weights, max_seq_len, device, cache_dtype, tp)
    raise ValueError(f"no tensor-parallel engine for family {spec.family!r}")
