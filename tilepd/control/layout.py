"""`CacheLayout`: how one prefill instance holds a layer's KV blocks (INTERFACES §2).

The connector builds it from vLLM's cache tensors and sends it in `hello`; the
decode node uses it to size regions in its receive buffer and to convert the bytes
it receives into the engine's native cache. Two ends agree on bytes only through
this model, so every size the wire depends on is derived here.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LAYOUT_VERSION = 1

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
        return self

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

    def buffer_bytes(self, max_seq_len: int) -> int:
        return self.num_layers * self.region_stride(max_seq_len)

    @property
    def layout_id(self) -> str:
        """A short human-readable identity, used in logs and mismatch messages."""
        extra = (
            f"k{self.head_size_k}v{self.head_size_v}" if self.kind == "attn" else f"r{self.kv_lora_rank}p{self.rope_dim}"
        )
        return (
            f"{self.kind}/v{self.layout_version}/L{self.num_layers}/bs{self.block_size}/H{self.num_heads}/"
            f"C{self.entry_width}/{extra}/{self.dtype}/{self.order}"
        )
