"""The CUDA-graph step's body (static windows, device-side position, in-graph sampler) run on CPU
gives exactly the eager step's tokens; window buckets cover every length."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilepd.engine import SamplingParams, load_engine
from tilepd.engine.cuda_graph import default_buckets


def test_buckets_cover_and_end_at_max() -> None:
    b = default_buckets(131072)
    assert b[0] == 256 and b[-1] == 131072 and b == sorted(set(b)) and len(b) < 40
    assert all(x % 256 == 0 for x in b[:-1])
    assert all(b2 <= max(b1 * 1.3, b1 + 256) for b1, b2 in zip(b, b[1:]))
    assert default_buckets(100) == [100]


@pytest.fixture(params=["sdpa", "bmm"])
def attention_impl(request: pytest.FixtureRequest):
    from tilepd.engine import layers

    before = layers.ATTENTION_IMPL["default"]
    layers.ATTENTION_IMPL["default"] = request.param
    yield request.param
    layers.ATTENTION_IMPL["default"] = before


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_static_step_equals_eager(family: str, attention_impl: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue("tiny_llama" if family == "llama" else "tiny_deepseek")
    ref = request.getfixturevalue("llama_ref" if family == "llama" else "deepseek_ref")
    eng = load_engine(model_dir, device="cpu", max_seq_len=300, dtype="float32", use_cuda_graph=True, num_speculative_tokens=0)
    assert eng.graph_step is not None and eng.graph_step.capture is False
    eng.graph_step.buckets = [16, 32, 48, 300]  # force window changes during the run
    eng.inject(ref.state)
    res = eng.decode(ref.tokens[0], 40, SamplingParams(ignore_eos=True), lambda t: None)
    assert res.tokens == ref.tokens[1:41]
    sampled = []
    for _ in range(2):
        eng.inject(ref.state)
        sampled.append(eng.decode(ref.tokens[0], 20, SamplingParams(temperature=0.8, top_p=0.9, seed=5), lambda t: None).tokens)
    eager = load_engine(model_dir, device="cpu", max_seq_len=300, dtype="float32", use_cuda_graph=False, num_speculative_tokens=0)
    eager.inject(ref.state)
    assert sampled[0] == sampled[1] == eager.decode(ref.tokens[0], 20, SamplingParams(temperature=0.8, top_p=0.9, seed=5), lambda t: None).tokens


@pytest.mark.slow
@pytest.mark.parametrize("include_attention", [True, False])
def test_torch_compiled_layers_give_the_same_tokens(include_attention: bool, tiny_llama: Path, llama_ref) -> None:
    """The GPU benchmark's compile variants, checked on CPU (inductor's C++ backend)."""
    eng = load_engine(tiny_llama, device="cpu", max_seq_len=128, dtype="float32", use_cuda_graph=True)
    eng.graph_step.buckets = [64, 128]
    eng.model.compile(include_attention=include_attention)
    eng.inject(llama_ref.state)
    res = eng.decode(llama_ref.tokens[0], 16, SamplingParams(ignore_eos=True), lambda t: None)
    assert res.tokens == llama_ref.tokens[1:17]
