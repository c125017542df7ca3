"""One prompt's prefill as vLLM's own histograms measure it (the difference of the host's /metrics across it): what
`tilepd capacity`'s fitted prefill is checked against."""

from __future__ import annotations

import random

import httpx

from tilepd.capacity.prefill_fit import one_request
from tilepd.capacity.sources import scrape


def measured_prefill_s(url: str, model: str, tokens: int, rng: random.Random, headers: dict[str, str] | None = None) -> float:
    """A `tokens`-token prompt of random ids sent to the vLLM at `url` (max_tokens 1); its prefill seconds."""
    before = scrape(url + "/metrics")
    ids = [rng.randrange(100, 300) for _ in range(tokens)]
    httpx.post(url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0},
               headers=headers or {}, timeout=300).raise_for_status()
    sample = one_request(before, scrape(url + "/metrics"))
    assert sample is not None and sample.tokens == tokens, sample
    return sample.seconds
