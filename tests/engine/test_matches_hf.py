"""Greedy decode from an injected prefix matches HF transformers token for token, logits within 1e-4."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilepd.engine import SamplingParams, load_engine

STEPS = 64
LOGIT_TOL = 1e-4  # float32 on CPU; the two implementations differ only in summation order


def _run(model_dir: Path, ref, **kw):
    engine = load_engine(model_dir, device="cpu", max_seq_len=256, dtype="float32", **kw)
    engine.eager_step.logits_log = []
    engine.inject(ref.state)
    seen: list[int] = []
    res = engine.decode(ref.tokens[0], STEPS, SamplingParams(ignore_eos=True), seen.append, None)
    return engine, res, seen


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_greedy_matches_hf_token_for_token(family: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue("tiny_llama" if family == "llama" else "tiny_deepseek")
    ref = request.getfixturevalue("llama_ref" if family == "llama" else "deepseek_ref")
    engine, res, seen = _run(model_dir, ref, num_speculative_tokens=0)
    assert res.tokens == ref.tokens[1 : STEPS + 1]
    assert seen == res.tokens and res.finish_reason == "length"
    diffs = [float((a - b).abs().max()) for a, b in zip(engine.eager_step.logits_log, ref.logits[1:])]
    print(f"{family}: max |logit diff| over {len(diffs)} steps = {max(diffs):.2e}")
    assert max(diffs) < LOGIT_TOL
    assert len(set(res.tokens)) > 8  # the reference itself is not degenerate
