"""MTP speculative decode (deepseek_v3, and DSA models) through the static verify+draft step (mtp.MtpStep),
run on CPU without capture: exactly plain greedy output (HF's tokens), whatever the drafts; acceptance reported.

Random MTP weights draft badly (mostly rejections); an oracle draft table (the bench's forced-acceptance
mode) with corrupted entries exercises acceptance and rejection in the same decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.conftest import DSA_STEPS
from tilepd.engine import SamplingParams, load_engine
from tilepd.engine.mtp import mtp_step

STEPS = 64
GREEDY = SamplingParams(ignore_eos=True)


def _engine(path: Path, k: int, max_seq_len: int = 256, buckets: list[int] | None = None):
    """A CPU engine whose MtpStep runs the graph's static body: fixed windows from `buckets` when given."""
    eng = load_engine(path, device="cpu", max_seq_len=max_seq_len, dtype="float32", num_speculative_tokens=k, use_cuda_graph=buckets is not None)
    if buckets is not None:  # the graph step's static windows (uncaptured on CPU), shared by the MTP step
        eng.graph_step.buckets = buckets
    return eng


def _decode(engine, ref, steps: int = STEPS, **sampling):
    engine.inject(ref.state)
    return engine.decode(ref.tokens[0], steps, SamplingParams(ignore_eos=True, **sampling), lambda t: None, None)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_step_equals_plain_greedy(k: int, tiny_deepseek: Path, deepseek_ref) -> None:
    engine = _engine(tiny_deepseek, k, buckets=[32, 48, 64, 256])  # windows change during the run
    assert engine.capabilities["speculative_mtp"] is True
    res = _decode(engine, deepseek_ref)
    assert res.tokens == deepseek_ref.tokens[1 : STEPS + 1]
    stats = engine.last_mtp_stats
    print(f"MTP k={k}: acceptance {stats['acceptance_rate']:.3f} ({stats['accepted']}/{stats['drafted']}), "
          f"{stats['target_steps']} target steps for {len(res.tokens)} tokens")
    assert stats["drafted"] > 0 and res.timings["acceptance_rate"] == stats["acceptance_rate"]


def _oracle(ref, every: int | None, vocab: int) -> list[int]:
    """tokens[i] = the token fed at position i (prompt, then HF's greedy continuation); every `every`-th wrong."""
    table = list(ref.prompt_ids) + list(ref.tokens)
    if every:
        for i in range(len(ref.prompt_ids) + 2, len(table), every):
            table[i] = (table[i] + 1) % vocab
    return table


def test_oracle_drafts_accept_and_reject(tiny_deepseek: Path, deepseek_ref) -> None:
    """Drafts from a table of the true tokens with every 5th one wrong: both paths of the acceptance, exact output."""
    engine = _engine(tiny_deepseek, 3)
    mtp_step(engine).set_oracle(_oracle(deepseek_ref, 5, engine.config.vocab_size))
    res = _decode(engine, deepseek_ref)
    assert res.tokens == deepseek_ref.tokens[1 : STEPS + 1]
    stats = engine.last_mtp_stats
    print(f"oracle k=3, every 5th draft wrong: acceptance {stats['acceptance_rate']:.3f}, {stats['target_steps']} target steps")
    assert 0.3 < stats["acceptance_rate"] < 0.9
    assert stats["target_steps"] < STEPS / 2


def test_forced_full_acceptance(tiny_deepseek: Path, deepseek_ref) -> None:
    """The bench's forced mode with the true tokens as drafts: every draft accepted, k+1 tokens per step, exact."""
    engine = _engine(tiny_deepseek, 3)
    mtp_step(engine).set_oracle(_oracle(deepseek_ref, None, engine.config.vocab_size), force=True)
    res = _decode(engine, deepseek_ref, steps=41)
    assert res.tokens == deepseek_ref.tokens[1:42]
    stats = engine.last_mtp_stats
    assert stats["acceptance_rate"] == 1.0 and stats["matched"] == stats["accepted"]
    assert stats["target_steps"] == 1 + 10  # first step: 1 token; then 4 per step


def test_stops_mid_step_and_at_max_tokens(tiny_deepseek: Path, deepseek_ref) -> None:
    engine = _engine(tiny_deepseek, 3)
    mtp_step(engine).set_oracle(_oracle(deepseek_ref, None, engine.config.vocab_size))
    truth = deepseek_ref.tokens[1:]
    stop_at = next(i for i in range(6, STEPS) if truth[i] not in truth[:i] and i % 4 != 0)
    res = _decode(engine, deepseek_ref, stop_token_ids=(truth[stop_at],))
    assert res.tokens == truth[: stop_at + 1] and res.finish_reason == "stop"
    assert engine.seq_len == deepseek_ref.state.seq_len + stop_at + 1  # cache filled up to the last emitted token
    res = _decode(engine, deepseek_ref, steps=7)
    assert res.tokens == truth[:7] and res.finish_reason == "length"


def test_cache_end_finishes_with_plain_steps(tiny_deepseek: Path, deepseek_ref) -> None:
    """Where the drafts would run past the cache, plain steps finish the decode: same tokens, cache filled exactly."""
    seq = deepseek_ref.state.seq_len
    engine = _engine(tiny_deepseek, 3, max_seq_len=seq + 20)
    res = _decode(engine, deepseek_ref)
    assert res.tokens == deepseek_ref.tokens[1:21] and res.finish_reason == "length"
    assert engine.seq_len == seq + 20


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("model", ["glm5", "dsv32"])
def test_dsa_models_mtp_step(model: str, k: int, dsa_ref, request: pytest.FixtureRequest) -> None:
    """DSA: the verify rows and the MTP layer (its own indexer) each select their own top-k; windows below and
    above index_topk (16); a corrupted oracle on k=3 mixes accepted and rejected drafts."""
    ref = dsa_ref(model, "long")
    eng = _engine(request.getfixturevalue(f"tiny_{model}"), k, buckets=[96, 128, 256])
    assert "mtp.0." in eng.model.index_caches
    if k == 3:
        mtp_step(eng).set_oracle(_oracle(ref, 4, eng.config.vocab_size))
    eng.inject(ref.state)
    assert eng.decode(ref.tokens[0], DSA_STEPS, GREEDY, lambda t: None).tokens == ref.tokens[1:]
    stats = eng.last_mtp_stats
    assert stats["drafted"] > 0
    if k == 3:
        assert 0 < stats["acceptance_rate"] < 1


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


def _eager_mtp_drafts(model, toks: list[int], hidden, positions: list[int], k: int) -> list[int]:
    """The reference drafter (the eager path this step replaced): the MTP layer on the accepted rows only,
    then k-1 recursive single-token steps, each over the exact live prefix."""
    import torch

    logits, h = model.mtp_forward(torch.tensor(toks), hidden, torch.tensor(positions), positions[-1] + 1)
    drafts = [int(torch.argmax(logits[-1]))]
    h = h[-1:]
    for j in range(1, k):
        p = positions[-1] + j
        logits, h = model.mtp_forward(torch.tensor(drafts[-1:]), h, torch.tensor([p]), p + 1)
        drafts.append(int(torch.argmax(logits[-1])))
    return drafts


@pytest.mark.parametrize("model", ["deepseek", "glm5"])
def test_mtp_drafts_equal_the_eager_drafter(model: str, request: pytest.FixtureRequest) -> None:
    """The static step runs the MTP layer on all k+1 rows (rejected ones included) over a fixed window; its drafts
    must be the eager drafter's, which sees the accepted rows only: rejected rows' cache slots are rewritten
    before anything reads them. An oracle with wrong entries gives every acceptance count 0..k."""
    import torch

    path = request.getfixturevalue("tiny_deepseek" if model == "deepseek" else "tiny_glm5")
    ref = request.getfixturevalue("deepseek_ref") if model == "deepseek" else request.getfixturevalue("dsa_ref")("glm5", "long")
    k = 3
    eng = _engine(path, k, buckets=[96, 128, 256])
    step = mtp_step(eng)
    table = _oracle(ref, None, eng.config.vocab_size)
    for i in range(len(ref.prompt_ids) + 3, len(table), 3):  # wrong drafts at varying offsets in the k-window
        table[i] = (table[i] + 7) % eng.config.vocab_size
    step.set_oracle(table)
    other_engine = _engine(path, 0)  # the reference runs on its own caches
    other_engine.inject(ref.state)
    other = other_engine.model
    eng.inject(ref.state)
    p, pending = ref.state.seq_len, ref.tokens[0]
    eng.io.token.fill_(pending)
    eng.io.position.fill_(p)
    step.first.fill_(1)
    counts = set()
    for i in range(12):
        used = [] if i == 0 else step.drafts.tolist()
        res = step(p)
        ids = torch.tensor([pending, *used])
        logits, hs = other.forward(ids, torch.arange(p, p + len(ids)), p + len(ids))
        out = torch.argmax(logits, dim=-1).tolist()
        n = 0
        while n < len(used) and used[n] == out[n]:
            n += 1
        assert res[0] == n and res[2 : 3 + n] == out[: n + 1]
        assert step.mtp_drafts.tolist() == _eager_mtp_drafts(other, out[: n + 1], hs[: n + 1], list(range(p, p + n + 1)), k)
        counts.add(n)
        pending, p = out[n], p + n + 1
    assert {0, 1, 2} <= counts, counts

