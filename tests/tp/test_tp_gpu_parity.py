"""GPU parity (marker gpu): 2 GPUs (NCCL, CUDA graphs per rank) decode exactly the greedy tokens 1 GPU decodes.

The GPU counterpart of test_tp_engine.py (gloo on CPU): the tiny llama and deepseek_v3 converted for tp 1 and 2
(fp32, conftest.py), one state injected, 48 greedy tokens, graphs off and on, and a second request on the same
(captured) ranks.

    pytest -m gpu tests/tp/test_tp_gpu_parity.py     # was `python bench/tp_gpu_parity.py --weights DIR`
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

TOKENS = 48


@pytest.mark.parametrize("graph", [False, True], ids=["graph-off", "graph-on"])
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_two_gpus_decode_the_one_gpu_tokens(family: str, graph: bool, request: pytest.FixtureRequest) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, {torch.cuda.device_count()} here")
    from tilepd.dev.synthetic import random_kv_state
    from tilepd.engine import SamplingParams, load_engine
    from tilepd.engine.tp_engine import launch_tp_engine

    weights: dict[int, Path] = request.getfixturevalue("tp_llama" if family == "llama" else "tp_deepseek")
    greedy = SamplingParams(ignore_eos=True)
    ref = load_engine(weights[1], device="cuda:0", max_seq_len=256, dtype="float32", use_cuda_graph=graph, num_speculative_tokens=0)
    state = random_kv_state(ref.config, 33, seed=3)
    ref.inject(state)
    want = ref.decode(5, TOKENS, greedy, lambda t: None).tokens
    del ref
    torch.cuda.empty_cache()
    tp = launch_tp_engine(weights[2], 2, device="cuda", max_seq_len=256, dtype="float32", use_cuda_graph=graph, num_speculative_tokens=0)
    try:
        tp.inject(state)
        got = tp.decode(5, TOKENS, greedy, lambda t: None).tokens
        tp.inject(state)
        again = tp.decode(5, TOKENS, greedy, lambda t: None).tokens  # a second request on the same (captured) ranks
    finally:
        tp.close()
    assert len(set(want)) > 3, f"the 1-GPU decode repeats itself ({want[:12]}): the comparison would say little"
    assert got == want == again, f"1 GPU {want[:12]}... 2 GPUs {got[:12]}... again {again[:12]}..."
