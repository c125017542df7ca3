"""The prefill time fitted as fixed + per-token parts from one prefill host's histograms, one probe request at a time."""

from __future__ import annotations

import pytest

from tilepd.capacity.prefill_fit import PrefillSample, fit, one_request, probe, probe_lengths
from tilepd.capacity.sources import Scrape


def _metrics(count: float, seconds: float, tokens: float) -> Scrape:
    """vLLM's two request histograms as it renders them (their +Inf buckets, sums and counts)."""
    return Scrape.parse(
        "# TYPE vllm:request_prefill_time_seconds histogram\n"
        f'vllm:request_prefill_time_seconds_bucket{{le="+Inf",model_name="m"}} {count}\n'
        f'vllm:request_prefill_time_seconds_count{{model_name="m"}} {count}\n'
        f'vllm:request_prefill_time_seconds_sum{{model_name="m"}} {seconds}\n'
        "# TYPE vllm:request_prompt_tokens histogram\n"
        f'vllm:request_prompt_tokens_bucket{{le="+Inf",model_name="m"}} {count}\n'
        f'vllm:request_prompt_tokens_count{{model_name="m"}} {count}\n'
        f'vllm:request_prompt_tokens_sum{{model_name="m"}} {tokens}\n')


def test_one_request_between_two_scrapes_and_only_one() -> None:
    assert one_request(_metrics(3, 1.0, 100), _metrics(4, 1.25, 612)) == PrefillSample(512, 0.25)
    assert one_request(_metrics(3, 1.0, 100), _metrics(5, 1.5, 700)) is None  # other traffic meanwhile
    assert one_request(_metrics(0, 0.0, 0), _metrics(1, 4.9, 21)) is None  # the host's first request: cold


def test_fit_recovers_a_fixed_and_a_per_token_part() -> None:
    samples = [PrefillSample(n, 0.020 + 0.0005 * n) for n in (16, 16, 128, 128, 512, 512)]
    f = fit(samples)
    assert f.fixed_s == pytest.approx(0.020) and f.per_token_s == pytest.approx(0.0005)
    assert f.requests == 6 and f.lengths == (16, 128, 512) and f.seconds(512) == pytest.approx(0.276)
    assert "6 request(s) of 16, 128, 512 tokens" in f.describe()
    one = fit([PrefillSample(512, 0.25), PrefillSample(512, 0.27)])  # one length: all of it per token
    assert one.fixed_s == 0 and one.per_token_s == pytest.approx(0.26 / 512)
    flat = fit([PrefillSample(16, 0.3), PrefillSample(512, 0.2)])  # noise over the length effect: a fixed time
    assert flat.per_token_s == 0 and flat.fixed_s == pytest.approx(0.25)
    steep = fit([PrefillSample(100, 0.01), PrefillSample(200, 0.05)])  # a negative fixed part: through the origin instead
    assert steep.fixed_s == 0 and steep.per_token_s > 0
    with pytest.raises(ValueError):
        fit([])


def test_one_slow_probe_of_three_does_not_move_the_fit() -> None:
    """Another job on the host slowed one probe threefold: each length's median is the fit's input."""
    samples = [PrefillSample(n, 0.020 + 0.0005 * n) for n in (16, 16, 16, 128, 128, 128, 512, 512)]
    samples.append(PrefillSample(512, 3 * (0.020 + 0.0005 * 512)))
    f = fit(samples)
    assert f.requests == 9 and f.seconds(512) == pytest.approx(0.276)


def test_probe_lengths_fit_the_model() -> None:
    assert probe_lengths(512, 2048) == [16] * 3 + [128] * 3 + [512] * 3
    assert probe_lengths(4096, 1024) == [16] * 3 + [255] * 3 + [1023] * 3
    assert probe_lengths(8, 2048) == [2] * 3 + [8] * 3


def test_probes_leave_out_the_cold_first_request_and_other_traffic() -> None:
    """A host whose first request took 4.9 s (the CPU box after `up`) and whose warm prefill is 20 ms + 0.5 ms/token;
    one probe shares its window with another client's request. (The host is a counter here: the logic under test
    is which differences count; the real vLLM's is tests/router/test_capacity_prefill.py.)"""
    state = {"count": 0.0, "seconds": 0.0, "tokens": 0.0, "calls": 0}

    def complete(ids: list[int]) -> None:
        state["calls"] += 1
        cold = state["count"] == 0
        state["count"] += 1
        state["seconds"] += 4.9 if cold else 0.020 + 0.0005 * len(ids)
        state["tokens"] += len(ids)
        if state["calls"] == 4:  # another client's request lands in this probe's window
            state["count"] += 1
            state["seconds"] += 0.1
            state["tokens"] += 30

    samples, dropped = probe(lambda: _metrics(state["count"], state["seconds"], state["tokens"]), complete, probe_lengths(512, 2048))
    assert dropped == 2 and len(samples) == 7
    f = fit(samples)
    assert f.seconds(512) == pytest.approx(0.276)
