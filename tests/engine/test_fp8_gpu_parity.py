"""GPU parity (marker gpu): fp8-converted tiny models decode on CUDA to the greedy tokens of the same engine on the
dequantised weights (the GPU half of tests/engine/test_fp8.py).

Tiny models of each family converted with `--dtype fp8` from an fp8 checkpoint (block scales, like the real
releases) decode on CUDA with graphs and the speed path (fp8 weights through the Triton GEMV); float32 compute, so
the tokens must equal those of the engine built on the dequantised weights, on a first and a second request
(the captured graphs). The models are made on the CPU first (tokenizers), once per module.

    pytest -m gpu tests/engine/test_fp8_gpu_parity.py
        # was the parity half of `python bench/fp8_gpu_parity.py prepare` (CPU) then `run` (GPU); the speed
        # half is bench/fp8_gemv_speed.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

FAMILIES = ("llama", "deepseek_v3", "glm5", "dsv32")  # tilepd.dev.tiny_model.FAMILIES
TOKENS = 48
DEVICE = "cuda:0"  # where the checks run (a dry run of this file's own logic can set cpu: the dequantise path)


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny HF models -> fp8 HF checkpoints -> converted --dtype fp8 weights, one dir per family."""
    from tilepd.dev.fp8_checkpoint import write_fp8_checkpoint
    from tilepd.dev.tiny_model import make_tiny_model
    from tilepd.weights import convert_weights

    tmp, out = tmp_path_factory.mktemp("fp8-hf"), tmp_path_factory.mktemp("fp8-models")
    for family in FAMILIES:
        hf = make_tiny_model(family, tmp / "hf" / family)
        fp8 = write_fp8_checkpoint(hf, tmp / "hf-fp8" / family)
        convert_weights(fp8, out / family, dtype="fp8", progress=False, force=True)
    return out


def _reference_engine(weights_dir: Path, dtype: torch.dtype, like):
    from tilepd.engine.engine import build_model, engine_for
    from tilepd.engine.weights_loader import load_weights
    from tilepd.model_format.block_fp8 import BlockFp8, dequantize

    _, w = load_weights(weights_dir, like.device, dtype)
    dense = {k: dequantize(v, torch.float32).to(dtype) if isinstance(v, BlockFp8) else v for k, v in w.items()}
    model = build_model(like.config, dense, like.max_seq_len, like.device, dtype)
    return engine_for(model, like.config, like.device, like.max_seq_len, use_cuda_graph=True,
                      num_speculative_tokens=like.num_speculative_tokens)


def _greedy(engine, state, n: int) -> list[int]:
    from tilepd.engine import SamplingParams

    engine.inject(state)
    return engine.decode(5, n, SamplingParams(ignore_eos=True), lambda t: None).tokens


def _state(engine, seq_len: int, seed: int):
    """A random prefix; DSA models also get random indexer keys for each layer that has an indexer cache."""
    from tilepd.dev.synthetic import random_kv_state

    state = random_kv_state(engine.config, seq_len, seed=seed)
    caches = getattr(engine.model, "index_cache_list", None)
    if caches is not None and getattr(engine.config, "is_dsa", False):
        g = torch.Generator().manual_seed(seed + 1)
        state.indexer = [None if c is None else torch.randn(seq_len, c.shape[1], generator=g) for c in caches()[: len(state.layers)]]
    return state


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_weights_decode_the_dequantised_reference_tokens(family: str, fp8_models: Path) -> None:
    from tilepd.engine import load_engine
    from tilepd.model_format.block_fp8 import BlockFp8

    eng = load_engine(fp8_models / family, device=DEVICE, max_seq_len=512, dtype="float32")
    assert any(isinstance(v, BlockFp8) for v in eng.model.w.values()), "no fp8 tensor was loaded"
    state = _state(eng, 40, seed=3)
    got = _greedy(eng, state, TOKENS)
    again = _greedy(eng, state, TOKENS)  # second request on the captured graphs
    want = _greedy(_reference_engine(fp8_models / family, torch.float32, eng), state, TOKENS)
    same = sum(a == b for a, b in zip(got, want))
    assert len(set(want)) > 3, f"the reference decode repeats itself ({want[:10]}): the comparison would say little"
    assert got == want == again, f"{family} path={eng.speed_path}: fp8 {got[:10]}... vs ref {want[:10]} ({same}/{TOKENS} equal)"
