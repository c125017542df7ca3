"""On-device token selection: greedy, temperature, top-k, top-p with per-request seeded noise.

Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), which equals a categorical draw and
needs no host sync and no data-dependent shapes, so it can live inside a CUDA graph. The noise is drawn
outside the graph from the request's own torch.Generator, which makes a seeded request reproducible.
"""

from __future__ import annotations

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[T, V] -> [T] argmax ids."""
    return torch.argmax(logits, dim=-1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """logits [V] (any float dtype); temperature/top_k/top_p 0-d device tensors (top_k <= 0: off);
    noise [V] uniform(0,1) float32. Returns a 1-element long tensor."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True)
    rank = torch.arange(sorted_p.shape[-1], device=logits.device)
    k = torch.where(top_k > 0, top_k, sorted_p.shape[-1])
    cum_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep = (rank < k) & ((cum_before < top_p) | (rank == 0))
    race = torch.where(keep, sorted_p, 0.0) / (-torch.log(noise.clamp_min(1e-20)))
    return order.gather(-1, torch.argmax(race, dim=-1, keepdim=True))


class SamplerState:
    """Static device tensors holding one request's sampling parameters and its noise (reused every step)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.temperature = torch.ones((), device=device)
        self.top_k = torch.zeros((), dtype=torch.long, device=device)
        self.top_p = torch.ones((), device=device)
        self.noise = torch.rand(vocab_size, device=device)
        self.generator: torch.Generator | None = None

    def configure(self, temperature: float, top_k: int, top_p: float, seed: int | None) -> None:
        self.temperature.fill_(max(temperature, 1e-5))
        self.top_k.fill_(top_k)
        self.top_p.fill_(top_p)
        gen = torch.Generator(device=self.device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(seed))
        self.generator = gen

    def draw_noise(self) -> None:
        """Refill the noise buffer in place (outside any graph; no sync)."""
        self.noise.uniform_(0.0, 1.0, generator=self.generator)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return sample(logits, self.temperature, self.top_k, self.top_p, self.noise)
