"""The engine boundary (INTERFACES §1): what the decode node calls (`DecodeEngine`), and the values that cross it
(sampling parameters, KV state, decode result)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from tilepd.model_format.model_spec import ModelSpec

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
    """Prefix cache in the engine layout: one tensor per layer, positions [0, seq_len).

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


@runtime_checkable
class DecodeEngine(Protocol):
    """What the decode node (tilepd.runtime.service, .server) calls on an engine: `Engine` (one rank), `TPEngine`
    (rank 0 driving N ranks) and the tests' stand-ins. Typed so the node calls these members without probing for them.

    `decode` also takes `logprobs=`, `on_logprobs=` and `grammar=` (keywords), but the node passes them only to an
    engine whose `capabilities` declare them (the HTTP API answers 501 otherwise)."""

    config: ModelSpec  # the model's shapes and stops (vocab_size, eos_token_ids) and the cache's dtype

    @property
    def capabilities(self) -> dict[str, Any]:
        """The request parameters this engine honours (INTERFACES §1); the node refuses the others by name."""
        ...

    def warmup(self) -> int:
        """Prepare what the first request would otherwise pay for (CUDA graphs); how many graphs exist."""
        ...

    def reset(self) -> None:
        """Forget the current request."""
        ...

    def inject(self, state: KVState) -> None:
        """Place a prefix (the prefill's KV, in the engine's layout) at positions [0, state.seq_len)."""
        ...

    def decode(self, first_token: int, max_tokens: int, sampling: SamplingParams, on_token: Callable[[int], None],
               cancel: threading.Event | None = None) -> DecodeResult:
        """Generate up to max_tokens after first_token, each handed to on_token as it is sampled."""
        ...

    def health_problem(self) -> str | None:
        """Why the engine cannot serve (a tensor-parallel worker rank died), or None."""
        ...

    def close(self) -> None:
        """Release what the engine holds outside this process (worker ranks); idempotent."""
        ...


class InProcessEngine:
    """The `DecodeEngine` members an engine living wholly in this process has nothing to do for."""

    def warmup(self) -> int:
        return 0  # nothing captured

    def health_problem(self) -> str | None:
        return None  # nothing that can die without this process

    def close(self) -> None:
        return None  # nothing outside this process to stop
