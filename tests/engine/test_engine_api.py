"""Engine API contract (INTERFACES §1): stops, max_tokens, cancel, capacity, bad input, capabilities."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tilepd.engine import CAPABILITIES, KVState, SamplingParams, load_engine
from tilepd.engine.types import DecodeEngine


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    return load_engine(tiny_llama, device="cpu", max_seq_len=64, dtype="float32")


def test_config_and_capabilities(engine) -> None:
    spec = engine.config
    assert spec.family == "llama" and spec.num_layers == 2 and spec.eos_token_ids == (1,)
    assert spec.cache_dtype == "float32" and spec.cache_heads == 2 and spec.cache_entry_width == 64
    caps = engine.capabilities
    for key in ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "max_tokens"):
        assert caps[key] is True
    for key in ("n", "presence_penalty", "frequency_penalty"):
        assert caps[key] is False
    assert caps["logprobs"] is True  # tests/engine/test_logprobs.py
    assert set(CAPABILITIES) <= set(caps)


def test_engine_is_what_the_decode_node_calls(engine) -> None:
    assert isinstance(engine, DecodeEngine)
    assert engine.health_problem() is None and engine.warmup() == 0  # one rank in this process, no CUDA graphs on CPU
    engine.close()
    assert engine.health_problem() is None  # nothing outside the process was stopped: it still serves
    assert not isinstance(object(), DecodeEngine)


def test_stop_token_ends_with_the_token_included(engine, llama_ref) -> None:
    truth = llama_ref.tokens[1:]
    i = next(i for i in range(3, 30) if truth[i] not in truth[:i])
    engine.inject(llama_ref.state)
    res = engine.decode(llama_ref.tokens[0], 40, SamplingParams(stop_token_ids=(truth[i],)), lambda t: None)
    assert res.tokens == truth[: i + 1] and res.finish_reason == "stop"


def test_eos_stops_unless_ignore_eos(tiny_llama: Path, llama_ref) -> None:
    truth = llama_ref.tokens[1:]
    eng = load_engine(tiny_llama, device="cpu", max_seq_len=64, dtype="float32")
    eng.config = eng.config.__class__(**{**eng.config.__dict__, "eos_token_ids": (truth[4],)})
    eng.inject(llama_ref.state)
    assert eng.decode(llama_ref.tokens[0], 30, SamplingParams(), lambda t: None).finish_reason == "stop"
    eng.inject(llama_ref.state)
    res = eng.decode(llama_ref.tokens[0], 30, SamplingParams(ignore_eos=True), lambda t: None)
    assert res.finish_reason == "length" and len(res.tokens) == 30


def test_cancel_stops_within_one_step(engine, llama_ref) -> None:
    cancel = threading.Event()
    seen: list[int] = []

    def on_token(t: int) -> None:
        seen.append(t)
        if len(seen) == 3:
            cancel.set()

    engine.inject(llama_ref.state)
    res = engine.decode(llama_ref.tokens[0], 40, SamplingParams(ignore_eos=True), on_token, cancel)
    assert res.finish_reason == "cancelled" and len(res.tokens) == 3 == len(seen)


def test_cache_capacity_ends_with_length(engine, llama_ref) -> None:
    engine.inject(llama_ref.state)
    n = len(llama_ref.prompt_ids)
    res = engine.decode(llama_ref.tokens[0], 1000, SamplingParams(ignore_eos=True), lambda t: None)
    assert res.finish_reason == "length" and len(res.tokens) == 64 - n


def test_bad_state_and_order_are_refused(engine, llama_ref) -> None:
    engine.reset()
    with pytest.raises(RuntimeError, match="before inject"):
        engine.decode(3, 4, SamplingParams(), lambda t: None)
    bad = KVState(seq_len=4, layers=[torch.zeros(4, 2, 32)] * 2)
    with pytest.raises(ValueError, match="expected"):
        engine.inject(bad)
    with pytest.raises(ValueError, match="layers"):
        engine.inject(KVState(seq_len=4, layers=[torch.zeros(4, 2, 64)]))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
