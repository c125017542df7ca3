"""DSA (sparse attention: glm_moe_dsa, deepseek_v32) against HF transformers, from HF's prefill state.

Prompts shorter than index_topk (16) and 5x longer; the eager step (with logits), the speculative MTP path,
and the CUDA-graph step's static body on CPU must all give HF's greedy tokens. Dense attention on the
same state is shown to give other tokens on the long prompt, so these tests can fail."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import DSA_STEPS, dsa_prompt, one_torch_thread
from tilepd.dev.hf_reference import hf_reference, vllm_indexer_fp8_round_trip
from tilepd.engine import KVState, SamplingParams, load_engine

MODELS = ["glm5", "dsv32"]
GREEDY = SamplingParams(ignore_eos=True)


def _engine(path: Path, **kw):
    kw = {"device": "cpu", "max_seq_len": 256, "dtype": "float32", "num_speculative_tokens": 0, **kw}
    return load_engine(path, **kw)


@pytest.mark.parametrize("prompt", ["short", "long"])
@pytest.mark.parametrize("model", MODELS)
def test_greedy_tokens_and_logits_match_hf(model: str, prompt: str, dsa_ref, request: pytest.FixtureRequest) -> None:
    ref = dsa_ref(model, prompt)
    path = request.getfixturevalue(f"tiny_{model}")
    eng = _engine(path)
    assert eng.config.is_dsa and eng.config.index_topk == 16
    eng.eager_step.logits_log = []
    eng.inject(ref.state)
    res = eng.decode(ref.tokens[0], DSA_STEPS, GREEDY, lambda t: None)
    diff = max(float((a - b).abs().max()) for a, b in zip(eng.eager_step.logits_log, ref.logits[1:]))
    print(f"{model}/{prompt}: max |logit diff| {diff:.2e}, {len(set(ref.tokens))} distinct tokens")
    assert res.tokens == ref.tokens[1:]
    assert diff < 1e-4
    assert len(set(ref.tokens)) >= 8  # a degenerate reference would prove little


@pytest.mark.parametrize("model", MODELS)
def test_speculative_mtp_path_gives_the_same_tokens(model: str, dsa_ref, request: pytest.FixtureRequest) -> None:
    """The MTP draft layer (its own indexer) and the 2-token verify step, each token with its own top-k."""
    ref = dsa_ref(model, "long")
    eng = _engine(request.getfixturevalue(f"tiny_{model}"), num_speculative_tokens=None)
    assert eng.num_speculative_tokens == 1 and "mtp.0." in eng.model.index_caches
    eng.inject(ref.state)
    assert eng.decode(ref.tokens[0], DSA_STEPS, GREEDY, lambda t: None).tokens == ref.tokens[1:]
    assert eng.last_mtp_stats["drafted"] > 0


@pytest.mark.parametrize("model", MODELS)
def test_static_graph_step_body_on_cpu(model: str, dsa_ref, request: pytest.FixtureRequest) -> None:
    """Fixed-size windows (some smaller than index_topk, some larger than the context): same tokens."""
    ref = dsa_ref(model, "long")
    eng = _engine(request.getfixturevalue(f"tiny_{model}"), use_cuda_graph=True)
    assert eng.graph_step is not None and eng.graph_step.capture is False
    eng.graph_step.buckets = [96, 128, 256]
    eng.inject(ref.state)
    assert eng.decode(ref.tokens[0], DSA_STEPS, GREEDY, lambda t: None).tokens == ref.tokens[1:]
    short = dsa_ref(model, "short")
    eng.graph_step.buckets = [8, 16, 24, 256]  # windows below, at and above index_topk
    eng.inject(short.state)
    assert eng.decode(short.tokens[0], DSA_STEPS, GREEDY, lambda t: None).tokens == short.tokens[1:]


@pytest.mark.parametrize("model", MODELS)
def test_dense_attention_would_decode_differently(model: str, dsa_ref, request: pytest.FixtureRequest) -> None:
    """With index_topk >= the window every position is selected (dense MLA): the short prompt's first step
    agrees with HF, the long prompt's tokens do not, so the sparse tests above can fail."""
    path = request.getfixturevalue(f"tiny_{model}")
    long, short = dsa_ref(model, "long"), dsa_ref(model, "short")
    eng = _engine(path)
    eng.model.spec = replace(eng.model.spec, index_topk=eng.max_seq_len)
    eng.eager_step.logits_log = []
    eng.inject(short.state)
    eng.decode(short.tokens[0], 1, GREEDY, lambda t: None)
    assert float((eng.eager_step.logits_log[0] - short.logits[1]).abs().max()) < 1e-4
    eng.eager_step.logits_log = []
    eng.inject(long.state)
    dense = eng.decode(long.tokens[0], DSA_STEPS, GREEDY, lambda t: None).tokens
    assert dense != long.tokens[1:]
    assert float((eng.eager_step.logits_log[0] - long.logits[1]).abs().max()) > 1e-2


def test_glm_shared_layer_reuses_the_previous_full_layers_topk(tiny_glm5: Path, dsa_ref) -> None:
    ref = dsa_ref("glm5", "long")
    eng = _engine(tiny_glm5)
    assert eng.config.indexer_types == ("full", "full", "shared")
    assert sorted(eng.model.index_caches) == ["layers.0.", "layers.1.", "mtp.0."]
    assert ref.state.indexer[2] is None and ref.state.indexer[0].shape == (80, 128)


def test_inject_refuses_a_dsa_state_without_indexer_keys(tiny_dsv32: Path, dsa_ref) -> None:
    ref = dsa_ref("dsv32", "short")
    eng = _engine(tiny_dsv32)
    with pytest.raises(ValueError, match="KVState.indexer .* is required; refusing to decode without it"):
        eng.inject(KVState(ref.state.seq_len, ref.state.layers))
    bad = [ref.state.indexer[0], ref.state.indexer[1][:, :64]]
    with pytest.raises(ValueError, match=r"KVState.indexer\[1\]: shape \[10, 64\], expected \[10, 128\]"):
        eng.inject(KVState(ref.state.seq_len, ref.state.layers, bad))
    with pytest.raises(ValueError, match="1 entries, KVState.layers 2"):
        eng.inject(KVState(ref.state.seq_len, ref.state.layers, ref.state.indexer[:1]))


def test_fp8_indexer_keys_match_hf_run_with_the_same_quantised_keys(tiny_glm5: Path) -> None:
    """vLLM's indexer cache keeps fp8 keys (one power-of-two scale per 128 values): the engine injected with
    those keys decodes what HF decodes when it caches the same round-tripped keys."""
    with one_torch_thread():
        ref = hf_reference(tiny_glm5, "glm5", 12, prompt_ids=dsa_prompt("long"), indexer_transform=vllm_indexer_fp8_round_trip)
    k = ref.state.indexer[0]
    assert torch.equal(vllm_indexer_fp8_round_trip(k), k) and 0 < float((k - k.round()).abs().max())
    eng = _engine(tiny_glm5)
    eng.inject(ref.state)
    assert eng.decode(ref.tokens[0], 12, GREEDY, lambda t: None).tokens == ref.tokens[1:]


@pytest.mark.slow
def test_two_tensor_parallel_ranks_decode_hfs_tokens(tiny_glm5: Path, dsa_ref) -> None:
    """TP=2 (gloo, a real worker process): MLA latent and indexer keys replicated, heads split; HF's tokens."""
    from tilepd.engine.tp_engine import launch_tp_engine

    ref = dsa_ref("glm5", "long")
    tp = launch_tp_engine(tiny_glm5, 2, max_seq_len=128)
    try:
        with pytest.raises(ValueError, match="KVState.indexer .* is required"):
            tp.inject(KVState(ref.state.seq_len, ref.state.layers))
        tp.inject(ref.state)  # the ranks are still in step after the refusal
        assert tp.decode(ref.tokens[0], DSA_STEPS, GREEDY, lambda t: None).tokens == ref.tokens[1:]
    finally:
        tp.close()


def test_converted_weights_decode_the_same(tiny_dsv32: Path, dsa_ref, tmp_path: Path) -> None:
    """convert-weights carries the indexer (weights_proj kept fp32); the converted directory decodes HF's tokens."""
    from tilepd.weights.convert import convert_weights

    ref = dsa_ref("dsv32", "long")
    convert_weights(tiny_dsv32, tmp_path / "w", dtype="fp32", progress=False)
    eng = _engine(tmp_path / "w")
    assert eng.model.w["layers.1.idx_weights_proj"].dtype == torch.float32
    eng.inject(ref.state)
    assert eng.decode(ref.tokens[0], DSA_STEPS, GREEDY, lambda t: None).tokens == ref.tokens[1:]
