"""The prefill time of a prompt, fitted as a fixed part plus a part per prompt token, from vLLM's own metrics.

vLLM's histograms (`vllm:request_prefill_time_seconds`, `vllm:request_prompt_tokens`) hold sums over every request
since the prefill started, and the first of them is cold (lazy initialisation, compiled kernels: on the CPU test
box one 21-token request took 4.9 s where a warm one takes tens of ms). A ratio of the sums right after `tilepd up`
is that first request, extrapolated: 234 ms per prompt token, 120 s for a 512-token prompt. Sums cannot tell a
fixed part from a per-token part either.

So each sample is one request, read as the difference of the host's histograms across it: the prefill host is
scraped, one probe prompt (random token ids: no prefix-cache hit; `max_tokens` 1, no tilepd marker: no decode node
is involved) is sent, and the host is scraped again. A probe whose difference counts other than one request (other
traffic meanwhile) is dropped, as is the host's very first request (its count was 0 before). The fit is least
squares of `seconds = fixed + per_token * tokens` over the median probe of each length (three per length: one probe
slowed by anything else on the host, a burst of another job, a page fault storm, cannot move it), both parts held
>= 0, and says how many requests it rests on.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tilepd.capacity.sources import Scrape

PREFILL_SECONDS = "vllm:request_prefill_time_seconds"
PROMPT_TOKENS = "vllm:request_prompt_tokens"
PROBE_REPEATS = 3  # probes per length: the fit takes each length's median
PROBE_TOKEN_IDS = (100, 300)  # ordinary ids of any real vocabulary (and the tiny test models', 512 wide)
SETTLE_S = 2.0  # how long a probe's request may take to show in the host's metrics after its answer


@dataclass(frozen=True)
class PrefillSample:
    """One request's prompt length and prefill seconds, as the prefill host's histograms counted it."""

    tokens: float
    seconds: float


@dataclass(frozen=True)
class PrefillFit:
    fixed_s: float
    per_token_s: float
    requests: int  # samples the fit rests on
    lengths: tuple[int, ...]  # the distinct prompt lengths among them

    def seconds(self, prompt_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * prompt_tokens

    def describe(self) -> str:
        return (f"{self.fixed_s * 1e3:.1f} ms + {self.per_token_s * 1e3:.4f} ms per prompt token, fitted on {self.requests} "
                f"request(s) of {', '.join(str(n) for n in self.lengths)} tokens")


def one_request(before: Scrape, after: Scrape) -> PrefillSample | None:
    """The request between two scrapes of one prefill host; None unless exactly one request ended there, or when it
    was the host's first (cold)."""
    count_before = before.total(f"{PREFILL_SECONDS}_count")
    count = after.total(f"{PREFILL_SECONDS}_count") - count_before
    tokens_count = after.total(f"{PROMPT_TOKENS}_count") - before.total(f"{PROMPT_TOKENS}_count")
    if count != 1 or tokens_count != 1 or count_before < 1:
        return None
    return PrefillSample(after.total(f"{PROMPT_TOKENS}_sum") - before.total(f"{PROMPT_TOKENS}_sum"),
                         after.total(f"{PREFILL_SECONDS}_sum") - before.total(f"{PREFILL_SECONDS}_sum"))


def fit(samples: Sequence[PrefillSample]) -> PrefillFit:
    """Least squares of seconds = fixed + per_token * tokens (each part at least 0) over each length's median sample;
    one length: all per token."""
    if not samples:
        raise ValueError("no prefill request to fit on")
    requests = len(samples)
    samples = medians(samples)
    n = len(samples)
    mean_x = sum(s.tokens for s in samples) / n
    mean_y = sum(s.seconds for s in samples) / n
    sxx = sum((s.tokens - mean_x) ** 2 for s in samples)
    lengths = tuple(sorted({int(s.tokens) for s in samples}))
    if sxx <= 0:  # one length: the parts cannot be told apart
        return PrefillFit(0.0, mean_y / mean_x if mean_x > 0 else 0.0, requests, lengths)
    per_token = sum((s.tokens - mean_x) * (s.seconds - mean_y) for s in samples) / sxx
    fixed = mean_y - per_token * mean_x
    if per_token < 0:  # noise larger than the length effect: a fixed time alone
        return PrefillFit(mean_y, 0.0, requests, lengths)
    if fixed < 0:  # through the origin instead
        per_token = sum(s.tokens * s.seconds for s in samples) / sum(s.tokens ** 2 for s in samples)
        fixed = 0.0
    return PrefillFit(fixed, per_token, requests, lengths)


def medians(samples: Sequence[PrefillSample]) -> list[PrefillSample]:
    """One sample per prompt length: the median seconds of that length's probes."""
    by_length: dict[float, list[float]] = {}
    for s in samples:
        by_length.setdefault(s.tokens, []).append(s.seconds)
    return [PrefillSample(tokens, statistics.median(secs)) for tokens, secs in sorted(by_length.items())]


def probe_lengths(prompt_tokens: int, max_seq_len: int) -> list[int]:
    """Short, a quarter and the asked prompt length (each fitting the model with room for one token), each repeated."""
    top = max(1, min(prompt_tokens, max_seq_len - 1))
    lengths = sorted({max(1, min(16, top)), max(1, top // 4), top})
    return [n for n in lengths for _ in range(PROBE_REPEATS)]


def probe(scrape: Callable[[], Scrape], complete: Callable[[list[int]], None], lengths: Sequence[int],
          seed: int = 0) -> tuple[list[PrefillSample], int]:
    """Send one prompt of each length between two scrapes of the host: (the samples kept, probes dropped)."""
    rng = random.Random(seed)
    kept: list[PrefillSample] = []
    dropped = 0
    for n in lengths:
        before = scrape()
        complete([rng.randrange(*PROBE_TOKEN_IDS) for _ in range(n)])
        after, deadline = scrape(), time.monotonic() + SETTLE_S
        while after.total(f"{PREFILL_SECONDS}_count") <= before.total(f"{PREFILL_SECONDS}_count") and time.monotonic() < deadline:
            time.sleep(0.05)
            after = scrape()
        sample = one_request(before, after)
        if sample is None:
            dropped += 1
        else:
            kept.append(sample)
    return kept, dropped
