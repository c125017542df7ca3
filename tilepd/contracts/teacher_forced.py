"""Teacher-forced verification: are a decode node's greedy tokens the ones the prefill's model would choose?

Token equality with the prefill's own greedy run is too strict across two engines' numerics (bf16 and fp8 kernels
legitimately flip near-ties, and after one flip the two continuations share nothing) and proves little on a tiny
random model. Instead the prefill scores the node's tokens: it is given prompt + the node's tokens as one prompt and
returns, for every position, the logprob of the token there and of its own top-1 (vLLM's `prompt_logprobs`). Each
token the node produced must be the prefill's top-1 at its position, or within `margin` nats of it. Every position
is judged given the node's own prefix (teacher forcing), so one near-tie flip does not condemn what follows, while
an engine whose numerics left the model's (a wrong kernel, scaled weights, another checkpoint with the same shapes)
picks tokens the prefill finds far less likely.

The margin (DEFAULT_MARGIN_NATS, docs/RELIABILITY.md): a token at most 1 nat below the top-1 (at least 37% of its
probability) passes. Two engines' logits on one model differ by far less on real bf16/fp8 models; a perturbed engine
misses by several nats at some position within a few tokens. The rule only holds for greedy decoding: a sampled
token is not meant to be the top-1.

One rule for the node canary of `tilepd up` (tilepd.deploy.canary), the router's divergence watch
(tilepd.router.divergence_watch), the demo, and the tests that score with HF as the prefill. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_MARGIN_NATS = 1.0


class ScoringError(ValueError):
    """The prefill's answer does not hold the scores asked for (an older vLLM, a proxy that drops fields)."""


@dataclass(frozen=True)
class PositionScore:
    """The prefill's view of one token the node produced: at `index` among the node's tokens (0: the first token,
    which the prefill sampled itself), `token` had `logprob`, and the prefill's own top-1 there was `top_token`."""

    index: int
    token: int
    logprob: float
    top_token: int
    top_logprob: float

    @property
    def gap(self) -> float:
        """How far below the top-1 the token is, in nats (0 when it is the top-1)."""
        return 0.0 if self.token == self.top_token else max(self.top_logprob - self.logprob, 0.0)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    checked: int  # tokens judged
    worst_gap: float  # the largest gap among them (nats)
    margin: float
    first_divergence: PositionScore | None = None  # the first token past the margin

    def describe(self) -> str:
        """One line: the verdict, and for a divergence its position and both logprobs."""
        if self.ok:
            return (f"agrees: {self.checked} tokens, each the prefill's top-1 or within {self.margin:g} nats of it "
                    f"(worst {self.worst_gap:.3f})")
        d = self.first_divergence
        assert d is not None
        return (f"diverges at token {d.index} of {self.checked}: the node chose {d.token} (prefill logprob {d.logprob:.3f}), the "
                f"prefill's top-1 is {d.top_token} (logprob {d.top_logprob:.3f}): {d.gap:.3f} nats below it, margin {self.margin:g}")

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.describe()}


def judge(scores: Sequence[PositionScore], margin: float = DEFAULT_MARGIN_NATS) -> Verdict:
    """The verdict over the node's tokens as the prefill scored them."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0 nats, got {margin}")
    worst = max((s.gap for s in scores), default=0.0)
    first = next((s for s in scores if s.gap > margin), None)
    return Verdict(first is None, len(scores), worst, margin, first)


def scoring_request(model: str, prompt: Sequence[int], tokens: Sequence[int]) -> dict[str, Any]:
    """The vLLM /v1/completions body that scores `tokens` after `prompt` (one extra token is generated and ignored)."""
    if not tokens:
        raise ValueError("no tokens to score")
    return {"model": model, "prompt": [*prompt, *tokens], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1,
            "stream": False}


def scores_from_vllm(body: dict[str, Any], prompt_len: int, tokens: Sequence[int]) -> list[PositionScore]:
    """`tokens`' scores from vLLM's answer to `scoring_request`: its `prompt_logprobs`, one {token id: {logprob,
    rank}} per position (None for the first), holding the token there and the top-1."""
    try:
        per_position = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ScoringError("the prefill's answer has no choices[0].prompt_logprobs") from None
    if not isinstance(per_position, list) or len(per_position) < prompt_len + len(tokens):
        raise ScoringError(f"the prefill scored {len(per_position) if isinstance(per_position, list) else 0} positions, "
                           f"{prompt_len + len(tokens)} were sent")
    out = []
    for i, token in enumerate(tokens):
        entry = per_position[prompt_len + i]
        try:
            own = entry[str(token)]
            top_id, top = min(entry.items(), key=lambda kv: (kv[1]["rank"], -kv[1]["logprob"]))
            out.append(PositionScore(i, int(token), float(own["logprob"]), int(top_id), float(top["logprob"])))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ScoringError(f"position {prompt_len + i}: no logprob for token {token} and a top-1 in {str(entry)[:200]}") from None
    return out
