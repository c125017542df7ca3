"""Values crossing the engine boundary (INTERFACES §1): sampling parameters, KV state, decode result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; temperature 0 means greedy. top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class KVState:
    """Prefix cache in the engine's native layout: one tensor per layer, positions [0, seq_len).

    llama: [seq_len, num_kv_heads, 2 * head_dim] (K then V); deepseek_v3: [seq_len, 1, kv_lora_rank + rope_dim]
    (normalised latent, then the roped key part, interleaved pairs as vLLM stores it).

    Sparse-attention models (DSA: glm_moe_dsa, deepseek_v32) also carry the lightning indexer's keys:
    `indexer[l]` is [seq_len, index_head_dim] for the same layers as `layers` (dequantised, roped as
    the prefill wrote them), None for a layer without its own indexer (GLM "shared" layers); `indexer`
    is None for models without an indexer.
    """

    seq_len: int
    layers: list[torch.Tensor]
    indexer: list[torch.Tensor] | None = None


@dataclass
class DecodeResult:
    tokens: list[int]
    finish_reason: FinishReason
    timings: dict[str, float] = field(default_factory=dict)
