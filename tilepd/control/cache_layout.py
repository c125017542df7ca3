"""`CacheLayout`: how one prefill instance holds a layer's KV blocks (INTERFACES §2).

The connector builds it from vLLM's cache tensors and sends it in `hello`; the
decode node uses it to size regions in its receive buffer and to convert the bytes
it receives into the engine layout of its cache. Two ends agree on bytes only through
this model, so every size the wire depends on is derived here.

Version 2 adds a second per-layer segment, the lightning indexer's key cache of DSA
models (glm_moe_dsa, deepseek_v32), with its own block size and encoding
(`IndexerLayout`). A transfer's regions are then: the main cache of every layer,
then the indexer cache of every layer that has one (in `indexer.layers` order).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LAYOUT_VERSION = 2

WireDType = Literal["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_ds_mla"]

ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8_e4m3": 1,
    "fp8_ds_mla": 1,  # entry_width counts bytes: 656 per token (512 fp8 + 16 scale bytes + 128 rope bytes)
}

# fp8_ds_mla packs one token as 512 fp8 latent values, 4 float32 scales (one per
# 128 values) and 64 bf16 rope values: 512 + 16 + 128 = 656 bytes.
FP8_DS_MLA_ENTRY_BYTES = 656

# vLLM 0.32's DeepseekV32IndexerCache quantises each key in groups of 128 values with one fp32 scale
# (model_executor/models/deepseek_v2.py:722-736: quant_block_size 128, head_dim + head_dim // 128 * 4 bytes).
INDEXER_QUANT_GROUP = 128


def indexer_token_bytes(head_dim: int) -> int:
    """Bytes one token's indexer key takes: head_dim fp8 values + one fp32 scale per 128 values (132 for 128)."""
    return head_dim + head_dim // INDEXER_QUANT_GROUP * 4


class IndexerLayout(BaseModel):
    """The indexer-key cache of a DSA model as it travels: block after block, each exactly as vLLM holds it.

    Encoding `fp8_e4m3_scale128` (vLLM's `indexer_k_quant_and_cache`, CUDA / non-shuffled layout): a block of
    `block_size` tokens is `block_size * head_dim` fp8 e4m3 values (token-major) followed by
    `block_size * head_dim / 128` fp32 scales; value = fp8 * scale.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    encoding: Literal["fp8_e4m3_scale128"] = "fp8_e4m3_scale128"
    layers: list[int] = Field(min_length=1, description="positions in the layout's layers that have an indexer cache, ascending")
    block_size: int = Field(gt=0)
    head_dim: int = Field(gt=0)

    @model_validator(mode="after")
    def _check(self) -> "IndexerLayout":
        if self.head_dim % INDEXER_QUANT_GROUP:
            raise ValueError(f"indexer head_dim {self.head_dim} is not a multiple of the {INDEXER_QUANT_GROUP}-value quant group")
        if any(b <= a for a, b in zip(self.layers, self.layers[1:])) or self.layers[0] < 0:
            raise ValueError(f"indexer layers must be ascending and >= 0, got {self.layers}")
        return self

    @property
    def token_bytes(self) -> int:
        return indexer_token_bytes(self.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    def blocks_for(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.block_size)

    def region_stride(self, max_seq_len: int) -> int:
        return math.ceil(max_seq_len / self.block_size) * self.block_bytes


class CacheLayout(BaseModel):
    """Per-layer physical layout of vLLM's paged KV cache as it travels on the wire."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["attn", "mla"]
    layout_version: int = LAYOUT_VERSION
    num_layers: int = Field(gt=0)
    block_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    entry_width: int = Field(gt=0, description="elements per (token, head) entry; bytes for fp8_ds_mla")
    dtype: WireDType
    order: Literal["BHNC", "BNHC"] = "BHNC"
    # attn only
    head_size_k: int | None = None
    head_size_v: int | None = None
    # mla only
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    # layout v2: DSA models also ship each indexer layer's key cache (absent for every other model)
    indexer: IndexerLayout | None = None
    # fp8_e4m3 caches only: the prefill's per-tensor KV scales per layer, as vLLM holds them after loading the
    # checkpoint (an entry is fp8 * scale). attn: k_scales and v_scales; mla: k_scales, the latent's one scale.
    # Absent: every scale is 1.0 (vLLM's default), and the hello is then exactly what a node before these fields reads.
    k_scales: tuple[float, ...] | None = None
    v_scales: tuple[float, ...] | None = None

    @model_validator(mode="after")
    def _check_kind_fields(self) -> "CacheLayout":
        if self.kind == "attn":
            if self.head_size_k is None or self.head_size_v is None:
                raise ValueError("attn layout needs head_size_k and head_size_v")
            if self.head_size_k + self.head_size_v != self.entry_width:
                raise ValueError(
                    f"attn layout: head_size_k {self.head_size_k} + head_size_v {self.head_size_v} "
                    f"!= entry_width {self.entry_width}"
                )
            if self.dtype == "fp8_ds_mla":
                raise ValueError("dtype fp8_ds_mla is only valid for kind 'mla'")
        else:
            if self.kv_lora_rank is None or self.rope_dim is None:
                raise ValueError("mla layout needs kv_lora_rank and rope_dim")
            if self.num_heads != 1:
                raise ValueError(f"mla layout has one latent head, got num_heads {self.num_heads}")
            if self.dtype == "fp8_ds_mla":
                if self.entry_width != FP8_DS_MLA_ENTRY_BYTES:
                    raise ValueError(f"fp8_ds_mla packs {FP8_DS_MLA_ENTRY_BYTES} bytes per token, got entry_width {self.entry_width}")
            elif self.kv_lora_rank + self.rope_dim != self.entry_width:
                raise ValueError(
                    f"mla layout: kv_lora_rank {self.kv_lora_rank} + rope_dim {self.rope_dim} "
                    f"!= entry_width {self.entry_width}"
                )
        self._check_scales()
        if self.indexer is not None:
            if self.kind != "mla":
                raise ValueError("an indexer segment comes only with an MLA (DSA) layout")
            if self.indexer.layers[-1] >= self.num_layers:
                raise ValueError(f"indexer layer {self.indexer.layers[-1]} is not below num_layers {self.num_layers}")
        return self

    def _check_scales(self) -> None:
        if self.k_scales is None and self.v_scales is None:
            return
        if self.dtype != "fp8_e4m3":
            raise ValueError(f"k_scales/v_scales come only with dtype fp8_e4m3 (got dtype {self.dtype})")
        if self.kind == "mla" and self.v_scales is not None:
            raise ValueError("an mla layout has one latent scale per layer: k_scales only, no v_scales")
        if self.kind == "attn" and (self.k_scales is None or self.v_scales is None):
            raise ValueError("an attn layout with KV scales needs both k_scales and v_scales")
        for name, scales in (("k_scales", self.k_scales), ("v_scales", self.v_scales)):
            if scales is None:
                continue
            if len(scales) != self.num_layers:
                raise ValueError(f"{name} has {len(scales)} entries for {self.num_layers} layers")
            bad = [(i, s) for i, s in enumerate(scales) if not (math.isfinite(s) and s > 0)]
            if bad:
                raise ValueError(f"{name}[{bad[0][0]}] = {bad[0][1]}: a KV scale must be finite and > 0")

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """(k, v) scale of one layer's fp8 entries (mla: the latent's scale twice); (1.0, 1.0) without scales."""
        k = self.k_scales[layer] if self.k_scales is not None else 1.0
        v = self.v_scales[layer] if self.v_scales is not None else k if self.kind == "mla" else 1.0
        return k, v

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in one layer (all heads)."""
        return self.num_heads * self.entry_width * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    def max_blocks(self, max_seq_len: int) -> int:
        return math.ceil(max_seq_len / self.block_size)

    def blocks_for(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.block_size)

    def region_stride(self, max_seq_len: int) -> int:
        """Distance between two layers' regions in the receive buffer."""
        return self.max_blocks(max_seq_len) * self.block_bytes

    def indexer_base(self, max_seq_len: int) -> int:
        """Offset of the first indexer region inside one sender's part of the buffer (after all main regions)."""
        return self.num_layers * self.region_stride(max_seq_len)

    def buffer_bytes(self, max_seq_len: int) -> int:
        """Bytes one sender's transfer may occupy: every main region, then every indexer region."""
        n = self.indexer_base(max_seq_len)
        if self.indexer is not None:
            n += len(self.indexer.layers) * self.indexer.region_stride(max_seq_len)
        return n

    def transfer_bytes(self, seq_len: int) -> int:
        """Bytes one sender writes for a request of `seq_len` tokens (all segments)."""
        n = self.num_layers * self.blocks_for(seq_len) * self.block_bytes
        if self.indexer is not None:
            n += len(self.indexer.layers) * self.indexer.blocks_for(seq_len) * self.indexer.block_bytes
        return n

    def regions(self, max_seq_len: int, seq_len: int) -> list[tuple[str, int, int, int]]:
        """(segment, layer, offset, length) of each region a request of `seq_len` tokens fills, in wire order
        (offsets relative to the sender's part of the buffer); checksums follow this order."""
        stride, n = self.region_stride(max_seq_len), self.blocks_for(seq_len) * self.block_bytes
        out = [("kv", l, l * stride, n) for l in range(self.num_layers)]
        if self.indexer is not None:
            ix, base = self.indexer, self.indexer_base(max_seq_len)
            istride, m = ix.region_stride(max_seq_len), ix.blocks_for(seq_len) * ix.block_bytes
            out += [("indexer", l, base + j * istride, m) for j, l in enumerate(ix.layers)]
        return out

    @property
    def layout_id(self) -> str:
        """A short human-readable identity, used in logs and mismatch messages."""
        extra = (
            f"k{self.head_size_k}v{self.head_size_v}" if self.kind == "attn" else f"r{self.kv_lora_rank}p{self.rope_dim}"
        )
        ix = self.indexer
        idx = f"/idx{len(ix.layers)}x{ix.head_dim}/bs{ix.block_size}/{ix.encoding}" if ix is not None else ""
        return (
            f"{self.kind}/v{self.layout_version}/L{self.num_layers}/bs{self.block_size}/H{self.num_heads}/"
            f"C{self.entry_width}/{extra}/{self.dtype}/{self.order}{idx}{'/kv_scales' if self.k_scales is not None else ''}"
        )
