"""Sampler: seeded reproducibility, top_k=1 == greedy, temperature/top_p shape the distribution as expected."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tilepd.engine import SamplingParams, load_engine
from tilepd.engine.sampling import sample

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
N = 20000


def _draws(temperature: float, top_k: int, top_p: float, seed: int = 1234) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(LOGITS))
    t, k, p = torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p)
    for _ in range(N):
        noise = torch.rand(len(LOGITS), generator=gen)
        counts[int(sample(LOGITS, t, k, p, noise))] += 1
    return counts / N


def test_frequencies_follow_softmax_with_temperature() -> None:
    for temp in (1.0, 0.5):
        freq = _draws(temp, 0, 1.0)
        expected = torch.softmax(LOGITS / temp, dim=-1)
        # 20k draws: binomial std <= 0.0036; 5 sigma
        assert float((freq - expected).abs().max()) < 0.018, (temp, freq, expected)
    # lower temperature concentrates mass on the argmax
    assert _draws(0.5, 0, 1.0)[0] > _draws(1.0, 0, 1.0)[0] + 0.1


def test_top_p_keeps_only_the_nucleus_renormalised() -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    cum = torch.cumsum(probs, 0)
    freq = _draws(1.0, 0, 0.7)
    keep = int((cum - probs < 0.7).sum())  # tokens whose preceding mass is below top_p
    assert float(freq[keep:].sum()) == 0.0
    expected = probs[:keep] / probs[:keep].sum()
    assert float((freq[:keep] - expected).abs().max()) < 0.02


def test_top_k_limits_support() -> None:
    freq = _draws(1.0, 3, 1.0)
    assert float(freq[3:].sum()) == 0.0 and float(freq[:3].min()) > 0.1
    assert float(_draws(1.0, 1, 1.0)[0]) == 1.0


@pytest.fixture(scope="module")
def llama_engine(tiny_llama: Path):
    return load_engine(tiny_llama, device="cpu", max_seq_len=256, dtype="float32")


def _gen(engine, ref, steps: int = 24, **kw) -> list[int]:
    engine.inject(ref.state)
    return engine.decode(ref.tokens[0], steps, SamplingParams(ignore_eos=True, **kw), lambda t: None, None).tokens


def test_seeded_requests_reproduce_and_differ_by_seed(llama_engine, llama_ref) -> None:
    a = _gen(llama_engine, llama_ref, temperature=1.0, seed=7)
    b = _gen(llama_engine, llama_ref, temperature=1.0, seed=7)
    c = _gen(llama_engine, llama_ref, temperature=1.0, seed=8)
    assert a == b
    assert a != c


def test_top_k_1_equals_greedy(llama_engine, llama_ref) -> None:
    greedy = _gen(llama_engine, llama_ref)
    assert greedy == llama_ref.tokens[1:25]
    assert _gen(llama_engine, llama_ref, temperature=1.3, top_k=1, seed=3) == greedy
    assert _gen(llama_engine, llama_ref, temperature=1.3, top_k=1, top_p=0.5) == greedy
