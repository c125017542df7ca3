"""Engine logprobs: the logits path decodes the same tokens as the plain step, and its logprobs are
log_softmax of HF's own logits for the same run (the reference vLLM's raw_logprobs also computes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tilepd.engine import SamplingParams, load_engine
from tilepd.engine.logprobs import TokenLogprobs

STEPS = 16


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    return load_engine(tiny_llama, device="cpu", max_seq_len=256, dtype="float32")


def _run(engine, ref, n: int | None, **kw) -> tuple[list[int], list[TokenLogprobs]]:
    engine.inject(ref.state)
    got: list[TokenLogprobs] = []
    res = engine.decode(ref.tokens[0], STEPS, SamplingParams(ignore_eos=True, **kw), lambda t: None, None,
                        logprobs=n, on_logprobs=got.append)
    return res.tokens, got


def test_greedy_logprobs_equal_hf_log_softmax(engine, llama_ref) -> None:
    tokens, lps = _run(engine, llama_ref, 3)
    assert tokens == llama_ref.tokens[1:STEPS + 1]
    assert [lp.token for lp in lps] == tokens
    for i, lp in enumerate(lps):
        ref = torch.log_softmax(llama_ref.logits[i + 1].float(), dim=-1)
        vals, ids = torch.topk(ref, 3)
        assert [t for t, _ in lp.top] == ids.tolist(), i
        assert max(abs(a - b) for (_, a), b in zip(lp.top, vals.tolist())) < 1e-4
        assert abs(lp.logprob - float(ref[lp.token])) < 1e-4
        assert lp.top[0][0] == lp.token  # greedy: the sampled token is the best one


def test_logits_path_samples_like_the_plain_step(engine, llama_ref) -> None:
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    engine.inject(llama_ref.state)
    plain = engine.decode(llama_ref.tokens[0], STEPS, SamplingParams(ignore_eos=True, **kw), lambda t: None, None).tokens
    tokens, lps = _run(engine, llama_ref, 0, **kw)
    assert tokens == plain
    assert all(lp.top == () and lp.logprob <= 0.0 for lp in lps)


def test_top_logprobs_bound_is_enforced(engine, llama_ref) -> None:
    engine.inject(llama_ref.state)
    with pytest.raises(ValueError, match="logprobs must be in"):
        engine.decode(llama_ref.tokens[0], 2, SamplingParams(), lambda t: None, None, logprobs=21)
    assert engine.capabilities["logprobs"] is True and engine.capabilities["top_logprobs_max"] == 20
