"""MTP speculative decode (deepseek_v3) produces exactly plain greedy output; acceptance is reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilepd.engine import SamplingParams, load_engine

STEPS = 64


def _decode(engine, ref, steps: int = STEPS, **sampling):
    engine.inject(ref.state)
    res = engine.decode(ref.tokens[0], steps, SamplingParams(ignore_eos=True, **sampling), lambda t: None, None)
    return res


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_speculative_equals_plain_greedy(k: int, tiny_deepseek: Path, deepseek_ref) -> None:
    engine = load_engine(tiny_deepseek, device="cpu", max_seq_len=256, dtype="float32", num_speculative_tokens=k)
    assert engine.capabilities["speculative_mtp"] is True
    res = _decode(engine, deepseek_ref)
    assert res.tokens == deepseek_ref.tokens[1 : STEPS + 1]
    stats = engine.last_spec_stats
    print(f"MTP k={k}: acceptance rate {stats['acceptance_rate']:.3f} ({stats['accepted']}/{stats['drafted']}), "
          f"{stats['target_steps']} target steps for {len(res.tokens)} tokens (random weights: low acceptance expected)")
    assert stats["drafted"] > 0 and res.timings["acceptance_rate"] == stats["acceptance_rate"]


def test_accepts_correct_drafts_and_rejects_wrong_ones(tiny_deepseek: Path, deepseek_ref) -> None:
    """An oracle drafter (a fake: random MTP weights rarely draft right) exercises the accept path:
    it proposes the true continuation but corrupts every 5th draft."""
    engine = load_engine(tiny_deepseek, device="cpu", max_seq_len=256, dtype="float32", num_speculative_tokens=3)
    truth = deepseek_ref.tokens[1:]
    calls = {"n": 0}

    def oracle(emitted: list[int], k: int) -> list[int]:
        start = len(emitted)
        drafts = [truth[start + j] if start + j < len(truth) else 0 for j in range(k)]
        calls["n"] += 1
        if calls["n"] % 5 == 0:
            drafts[0] = (drafts[0] + 1) % engine.config.vocab_size
        return drafts

    engine.drafter = oracle
    res = _decode(engine, deepseek_ref)
    assert res.tokens == truth[:STEPS]
    stats = engine.last_spec_stats
    print(f"oracle drafter k=3: acceptance {stats['acceptance_rate']:.3f}, {stats['target_steps']} target steps for {STEPS} tokens")
    assert 0.5 < stats["acceptance_rate"] < 1.0
    assert stats["target_steps"] < STEPS / 2


def test_speculative_stops_mid_round_on_stop_token(tiny_deepseek: Path, deepseek_ref) -> None:
    engine = load_engine(tiny_deepseek, device="cpu", max_seq_len=256, dtype="float32", num_speculative_tokens=3)
    truth = deepseek_ref.tokens[1:]
    engine.drafter = lambda emitted, k: [truth[min(len(emitted) + j, len(truth) - 1)] for j in range(k)]
    stop_at = next(i for i in range(5, STEPS) if truth[i] not in truth[:i])
    res = _decode(engine, deepseek_ref, stop_token_ids=(truth[stop_at],))
    assert res.tokens == truth[: stop_at + 1] and res.finish_reason == "stop"
    res = _decode(engine, deepseek_ref, steps=7)
    assert res.tokens == truth[:7] and res.finish_reason == "length"


def test_state_with_mtp_layer_kv_is_accepted(tiny_deepseek: Path, deepseek_ref) -> None:
    """A prefill that ran the MTP layer ships its KV as one more layer; decoding stays exact greedy."""
    import torch

    from tilepd.engine import KVState

    engine = load_engine(tiny_deepseek, device="cpu", max_seq_len=256, dtype="float32", num_speculative_tokens=2)
    st = deepseek_ref.state
    extra = torch.randn_like(st.layers[0])
    engine.inject(KVState(st.seq_len, [*st.layers, extra]))
    assert int(engine.model.mtp_start) == 0
    assert torch.equal(engine.model.mtp_caches[0][: st.seq_len], extra)
    res = engine.decode(deepseek_ref.tokens[0], 16, SamplingParams(ignore_eos=True), lambda t: None)
    assert res.tokens == deepseek_ref.tokens[1:17]
    with pytest.raises(ValueError, match="with the MTP layers"):
        engine.inject(KVState(st.seq_len, st.layers[:1]))
