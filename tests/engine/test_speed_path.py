"""The CUDA speed path (compiled.accelerate, attention.split_kv_attention, GraphStep fallbacks).

The kernel and graph-capture tests need a GPU and skip elsewhere; on CPU the 'triton' attention setting
must fall back to SDPA and give the reference tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tilepd.engine import SamplingParams, layers, load_engine
from tilepd.engine.compiled import accelerate

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def restore_attention_impl():
    before, before_gemv = layers.ATTENTION_IMPL["default"], layers.GEMV_IMPL["dense"]
    yield
    layers.ATTENTION_IMPL["default"] = before
    layers.GEMV_IMPL["dense"] = before_gemv


def test_accelerate_on_cpu_keeps_tokens_and_undoes_in_order(tiny_llama: Path, llama_ref, restore_attention_impl) -> None:
    eng = load_engine(tiny_llama, device="cpu", max_seq_len=128, dtype="float32", use_cuda_graph=True)
    assert eng.speed_path == "eager"  # load_engine turns the speed path on only on CUDA
    path = accelerate(eng.model, compile_layers=False)
    assert path.name == "fused-gemv+triton-attn+graph" and layers.ATTENTION_IMPL["default"] == "triton"
    assert layers.GEMV_IMPL["dense"] == "triton"  # Llama family: the fused dense GEMV (taken on CUDA tensors only)
    eng.graph_step.buckets = [64, 128]
    eng.inject(llama_ref.state)
    assert eng.decode(llama_ref.tokens[0], 16, SamplingParams(ignore_eos=True), lambda t: None).tokens == llama_ref.tokens[1:17]
    assert path.fallbacks[0]() == "dense GEMVs back to torch" and layers.GEMV_IMPL["dense"] == "torch"
    assert path.fallbacks[1]() == "attention back to sdpa" and layers.ATTENTION_IMPL["default"] == "sdpa"


def _reference(q, k, v, bias, scale):
    return layers.cached_attention(q.float(), k.float(), v.float(), bias.float(), scale, impl="bmm")


@cuda
@pytest.mark.parametrize("length,live,t", [(1, 1, 1), (100, 37, 1), (1296, 1100, 1), (8464, 8300, 1), (520, 300, 3)])
def test_split_kv_attention_matches_reference(length: int, live: int, t: int) -> None:
    from tilepd.engine.attention import split_kv_attention

    torch.manual_seed(0)
    h, hkv, d = 32, 8, 128
    cache = torch.randn(length, hkv, 2 * d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(live - t, live, device="cuda")
    bias = layers.attention_bias(layers.length_mask(positions, length), h // hkv, torch.bfloat16)
    got = split_kv_attention(q, cache[..., :d], cache[..., d:], bias, d**-0.5)
    want = _reference(q, cache[..., :d], cache[..., d:], bias, d**-0.5)
    assert got.shape == (t, h, d)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@cuda
def test_cuda_speed_path_tokens_and_fallback(tiny_llama: Path, llama_ref, restore_attention_impl) -> None:
    """load_engine's default CUDA path gives the reference tokens (float32), and a capture failure (injected:
    a layer function that raises, standing in for a compiler error) falls back instead of failing."""
    eng = load_engine(tiny_llama, device="cuda", max_seq_len=128, dtype="float32")
    assert eng.speed_path == "compile(no-attn)+fused-gemv+triton-attn+graph"
    eng.graph_step.buckets = [64, 128]
    eng.inject(llama_ref.state)
    assert eng.decode(llama_ref.tokens[0], 16, SamplingParams(ignore_eos=True), lambda t: None).tokens == llama_ref.tokens[1:17]
    assert eng.graph_step.capture_error is None and len(eng.graph_step.graphs) >= 1

    eng = load_engine(tiny_llama, device="cuda", max_seq_len=128, dtype="float32")

    def broken(*args, **kwargs):
        raise RuntimeError("injected compiler failure")

    eng.model.attn_in = broken
    eng.graph_step.buckets = [64, 128]
    eng.inject(llama_ref.state)
    assert eng.decode(llama_ref.tokens[0], 16, SamplingParams(ignore_eos=True), lambda t: None).tokens == llama_ref.tokens[1:17]
    assert "injected" in eng.graph_step.capture_error and eng.graph_step.capture and len(eng.graph_step.fallbacks) == 2
