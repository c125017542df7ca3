"""Per-token logprobs of the decode engine, computed as vLLM does (its default `raw_logprobs` mode).

vLLM takes log_softmax of the float32 logits the sampler receives (after a structured-output bitmask,
before temperature and top-k/top-p), reports the sampled token's value and the top-n. Doing the same
here keeps the low-latency pool's logprobs equal to a stock vLLM's for the same run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_LOGPROBS_MAX = 20  # as vLLM's default max_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprob and the `top` highest (token id, logprob) pairs, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]

    def to_json(self) -> dict[str, object]:
        return {"logprob": self.logprob, "top_logprobs": [[t, v] for t, v in self.top]}


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    """logits [V] (any float dtype, any device) -> the sampled token's logprob and the top_n best."""
    if not 0 <= top_n <= TOP_LOGPROBS_MAX:
        raise ValueError(f"top_logprobs must be in [0, {TOP_LOGPROBS_MAX}], got {top_n}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp[token]
    if top_n:
        vals, ids = torch.topk(lp, top_n)
        packed = torch.cat([chosen.view(1), vals]).cpu().tolist()  # one device->host copy
        top = tuple(zip(ids.cpu().tolist(), packed[1:]))
        return TokenLogprobs(token, packed[0], top)
    return TokenLogprobs(token, float(chosen.cpu()), ())
