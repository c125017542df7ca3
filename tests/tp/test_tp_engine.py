"""2 ranks (gloo, CPU, real worker process) decode exactly the greedy tokens 1 rank decodes.

The test process is rank 0 (`launch_tp_engine`), rank 1 is a real `python -m tilepd.engine.tp_worker`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tilepd.dev.synthetic import random_kv_state
from tilepd.engine import SamplingParams, load_engine
from tilepd.engine.tp_engine import launch_tp_engine
from tilepd.engine.types import DecodeEngine

N_TOKENS = 40
GREEDY = SamplingParams(ignore_eos=True)


def _reference(weights: Path, state, first: int, **kw) -> list[int]:
    eng = load_engine(weights, max_seq_len=128, **kw)
    eng.inject(state)
    return eng.decode(first, N_TOKENS, GREEDY, lambda t: None).tokens


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_two_ranks_match_one_rank(family: str, request: pytest.FixtureRequest) -> None:
    weights = request.getfixturevalue("tp_llama" if family == "llama" else "tp_deepseek")
    tp = launch_tp_engine(weights[2], 2, max_seq_len=128)
    try:
        assert tp.config.family == family and tp.tp_size == 2 and isinstance(tp, DecodeEngine)
        state = random_kv_state(tp.config, 17)
        want = _reference(weights[1], state, 7)
        tp.inject(state)
        seen: list[int] = []
        got = tp.decode(7, N_TOKENS, GREEDY, seen.append)
        assert got.tokens == want and seen == want and len(want) == N_TOKENS
        assert len(set(want)) > 3  # a real sequence, not one repeated id

        # Lockstep survives a cancel (rank 0's flag reaches rank 1) and a second request reuses the ranks.
        cancel = threading.Event()
        cancel.set()
        tp.inject(state)
        assert tp.decode(7, N_TOKENS, GREEDY, lambda t: None, cancel).finish_reason == "cancelled"
        tp.reset()
        state2 = random_kv_state(tp.config, 9, seed=1)
        tp.inject(state2)
        assert tp.decode(3, N_TOKENS, GREEDY, lambda t: None).tokens == _reference(weights[1], state2, 3)
        # A token callback that raises stops every rank (not only rank 0) and reaches the caller; the
        # ranks stay in step for the next request.
        def boom(tok: int) -> None:
            raise ConnectionError("client went away")

        tp.inject(state2)
        with pytest.raises(ConnectionError):
            tp.decode(3, N_TOKENS, GREEDY, boom)
        # A sampled decode without a seed: every rank draws the same tokens (rank 0 hands out the seed).
        tp.inject(state2)
        sampled = tp.decode(3, 8, SamplingParams(temperature=1.0, ignore_eos=True), lambda t: None)
        assert len(sampled.tokens) == 8
    finally:
        tp.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_graph_step_body_on_two_ranks_matches(family: str, request: pytest.FixtureRequest) -> None:
    """The CUDA-graph step's static-shape body (run eagerly on CPU), all-reduces inside, plain greedy (no MTP)
    on 2 ranks against plain greedy on 1 rank."""
    weights = request.getfixturevalue("tp_llama" if family == "llama" else "tp_deepseek")
    tp = launch_tp_engine(weights[2], 2, max_seq_len=128, num_speculative_tokens=0, use_cuda_graph=True)
    try:
        assert tp.local.graph_step is not None
        state = random_kv_state(tp.config, 12, seed=2)
        tp.inject(state)
        got = tp.decode(5, N_TOKENS, GREEDY, lambda t: None).tokens
        assert got == _reference(weights[1], state, 5, num_speculative_tokens=0)
    finally:
        tp.close()


def test_uneven_split_is_refused_before_starting_ranks(tp_llama: dict[int, Path]) -> None:
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        launch_tp_engine(tp_llama[1], 4, max_seq_len=64)


@pytest.mark.slow
def test_dead_worker_rank_is_reported_not_hung(tp_llama: dict[int, Path]) -> None:
    """A worker rank that dies (killed here: a crash cannot be produced on demand) fails the next call with
    a message naming the rank, instead of rank 0 waiting forever in a collective."""
    tp = launch_tp_engine(tp_llama[2], 2, max_seq_len=64)
    try:
        tp.workers[0].kill()
        tp.workers[0].wait(10)
        with pytest.raises(RuntimeError, match=r"rank 1 \(exit -9\)"):
            tp.inject(random_kv_state(tp.config, 4))
    finally:
        tp.close()
