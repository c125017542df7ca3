"""DSA's indexer kernels (dsa_indexer.py) and top-k select (dsa_topk.py), run by Triton's CPU interpreter,
against the torch ops they replace (dsa.select_topk's reference path, torch.topk). The select is compared
by value (the sorted values of the chosen slots equal torch.topk's, no slot twice), so a different choice
among equal values passes and a wrong set fails. Small blocks, so every row spans several loop iterations;
lengths off the block, heavy ties, -inf (invalid) slots, k = L, T > 1, head counts below the dot's 16."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")

_TOPK = textwrap.dedent("""
    import torch
    from tilepd.engine import dsa_topk as M
    M.TUNE.update(block=64, chunk=96, chunk_block=32)
    g = torch.Generator().manual_seed(0)
    def check(scores, valid, k, what, fused):
        # one program per row, then the chunked launches (split, refine, finish: its own launch, or the refine's last
        # program of each row, alternating over the cases so that each form meets every kind of row; the histogram
        # brought by the scores kernel is test_indexer's)
        for one_program_max in (1 << 30, 0):
            M.TUNE.update(one_program_max=one_program_max, fused_finish=fused)
            check_one(scores, valid, k, f"{what} one_program_max={one_program_max} fused_finish={fused}")
    def check_one(scores, valid, k, what):
        idx, ok = M.topk_select(scores, valid, k)
        assert idx.shape == (scores.shape[0], k) and idx.dtype == torch.int64 and ok.dtype == torch.bool, what
        ref = scores.topk(k, dim=-1).values
        for r in range(scores.shape[0]):
            assert len(set(idx[r].tolist())) == k, (what, r, "a slot chosen twice")
            got = scores[r, idx[r]].sort(descending=True).values
            assert torch.equal(got, ref[r]), (what, r, got[:8], ref[r][:8])
        assert torch.equal(ok, valid.gather(1, idx)), what
    n = 0
    for shape, (length, k, t) in enumerate(((300, 16, 1), (1000, 64, 2), (77, 77, 3), (64, 64, 1), (1, 1, 1), (513, 100, 4), (2000, 1999, 1))):
        valid = torch.rand(t, length, generator=g) > 0.2
        normal = torch.randn(t, length, generator=g).masked_fill(~valid, float("-inf"))
        ties = torch.randint(0, 4, (t, length), generator=g).float().masked_fill(~valid, float("-inf"))
        few = normal.clone()  # fewer valid slots than k: -inf ties fill the selection, ok says so
        few[:, : length - k // 2] = float("-inf")
        few_valid = valid.clone()
        few_valid[:, : length - k // 2] = False
        close = 1.0 + torch.randint(0, 3, (t, length), generator=g).float() * 2**-23  # keys differing in the last bits
        for kind, (name, s, v) in enumerate((("normal", normal, valid), ("ties", ties, valid), ("few-valid", few, few_valid),
                                              ("last-bits", close, valid), ("negative", -normal.abs() - 1, valid),
                                              ("all-invalid", torch.full((t, length), float("-inf")), torch.zeros(t, length, dtype=torch.bool)))):
            check(s.contiguous(), v, k, f"{name} L={length} k={k} T={t}", (shape + kind) % 2)
            n += 1
    print("topk ok", n)
""")

_INDEXER = textwrap.dedent("""
    import torch
    from tilepd.engine import dsa_indexer as M
    from tilepd.engine.dsa import indexer_key, _rope_head
    from tilepd.engine.rope import apply_rope_interleaved, apply_rope_neox, rope_table
    from tilepd.engine import dsa_topk
    M.TUNE.update(block_l=16, programs=2)  # rows of 37-100 keys: 1-4 blocks a program, 2-3 programs a row
    dsa_topk.TUNE.update(block=32, chunk=48, chunk_block=16)
    g = torch.Generator().manual_seed(0)
    D, ROPE, SLOTS = 128, 64, 200
    turn = 0
    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for interleaved in (True, False):
            rope_fn = apply_rope_interleaved if interleaved else apply_rope_neox
            table = rope_table(ROPE, 10000.0, None, 4096, SLOTS, torch.device("cpu"), dtype, interleaved=interleaved)
            for t, heads, length in ((1, 8, 37), (2, 32, 100), (3, 5, 16)):
                positions = torch.arange(length - t, length)
                cs = table.index_select(0, positions)
                kx = torch.randn(t, D, generator=g).to(dtype)
                w = {"k_norm": (1 + 0.1 * torch.randn(D, generator=g)).to(dtype), "k_norm_bias": (0.1 * torch.randn(D, generator=g)).to(dtype)}
                cache = torch.randn(SLOTS, D, generator=g).to(dtype)
                ref_cache = cache.clone()
                M.write_index_keys(kx, w["k_norm"], w["k_norm_bias"], cs, positions, cache, ROPE, interleaved)
                ref_k = torch.nn.functional.layer_norm(kx, (D,), w["k_norm"], w["k_norm_bias"], 1e-6)
                ref_cache.index_copy_(0, positions, _rope_head(ref_k.view(t, 1, D), cs, ROPE, rope_fn).view(t, D))
                err = float((cache.float() - ref_cache.float()).abs().max())
                assert err < tol, ("keys", dtype, interleaved, t, err)
                q = torch.randn(t, heads, D, generator=g).to(dtype)
                weights = torch.randn(t, heads, generator=g)
                valid = torch.rand(t, length, generator=g) > 0.3
                got = M.index_scores(q, cs, weights, cache, valid, ROPE, interleaved)
                qr = _rope_head(q, cs, ROPE, rope_fn)
                sc = torch.relu(torch.matmul(qr.float(), cache[:length].float().t()) * D**-0.5)
                want = torch.matmul((weights * heads**-0.5).unsqueeze(1), sc).squeeze(1).masked_fill(~valid, float("-inf"))
                assert got.shape == want.shape and got.dtype == torch.float32
                assert torch.equal(torch.isinf(got), ~valid), ("masking", dtype, interleaved, t)
                err = float((got - want).masked_fill(~valid, 0).abs().max() / want.masked_fill(~valid, 0).abs().max())
                assert err < tol, ("scores", dtype, interleaved, t, heads, err)
                # the fused select: the scores kernel's top-byte histogram, then split + finish; same set as torch.topk
                hist = dsa_topk.new_hist(t, cache.device)
                again = M.index_scores(q, cs, weights, cache, valid, ROPE, interleaved, hist=hist)
                assert torch.equal(again, got), ("scores with the histogram", dtype, interleaved, t)
                keys = got.view(torch.int32) ^ ((got.view(torch.int32) >> 31) & 0x7FFFFFFF)
                want_hist = torch.stack([torch.bincount(((r >> 24) + 128) & 255, minlength=256) for r in keys]).int()
                assert torch.equal(hist[:, :256], want_hist), ("top-byte histogram", dtype, interleaved, t)
                # the finish as its own launch or in the refine's last program, a fresh scratch a call or the kept one
                # (twice in a row: its first use must leave it zero for the second); the default (both) every case,
                # the three other forms taking turns over the cases beside it
                turn += 1
                other = ((0, 0), (1, 0), (0, 1))[turn % 3]
                for fused, kept in ((1, 1), (1, 1), other):
                    dsa_topk.TUNE.update(fused_finish=fused, scratch=kept)
                    for k in (11, length):
                        idx, ok = M.index_topk(q, cs, weights, cache, valid, ROPE, interleaved, k)
                        ref = got.topk(k, dim=-1).values
                        for r in range(t):
                            assert len(set(idx[r].tolist())) == k, ("a slot chosen twice", k, r, fused, kept)
                            assert torch.equal(got[r, idx[r]].sort(descending=True).values, ref[r]), ("index_topk set", dtype, k, r, fused, kept)
                        assert torch.equal(ok, valid.gather(1, idx)), ("index_topk ok", k, fused, kept)
                        if kept:
                            assert not dsa_topk.scratch(t, cache.device).any(), ("the kept scratch left dirty", fused, k)
                dsa_topk.TUNE.update(scratch=1)  # a select refused after the scores' histogram went in: the scratch is zeroed again
                try:
                    M.index_topk(q, cs, weights, cache, valid, ROPE, interleaved, length + 1)
                    raise AssertionError("k past L was not refused")
                except ValueError as e:
                    assert "outside 1..L" in str(e), e
                assert not dsa_topk.scratch(t, cache.device).any(), "the kept scratch left dirty by a refused select"
                dsa_topk.TUNE.update(fused_finish=1, scratch=1)
    print("indexer ok")
""")

def _interpret(code: str, repo_root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_topk_select_matches_torch_topk_under_interpreter(repo_root: Path) -> None:
    """Same values as torch.topk for every row, ties and -inf included; ok is valid at the chosen slots."""
    r = _interpret(_TOPK, repo_root)
    assert r.returncode == 0 and "topk ok 42" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.slow
def test_indexer_kernels_match_the_torch_ops_under_interpreter(repo_root: Path) -> None:
    """Key LayerNorm + RoPE + cache write and the head-weighted relu scores, both RoPE layouts, fp32 and bf16."""
    r = _interpret(_INDEXER, repo_root)
    assert r.returncode == 0 and "indexer ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_topk_select_refuses_bad_input_by_name() -> None:
    from tilepd.engine import dsa_topk

    scores, valid = torch.zeros(1, 10), torch.ones(1, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"k=11 outside 1..L=10"):
        dsa_topk.topk_select(scores, valid, 11)
    with pytest.raises(ValueError, match="scores dtype torch.bfloat16"):
        dsa_topk.topk_select(scores.bfloat16(), valid, 4)
    with pytest.raises(ValueError, match=r"valid \(1, 9\)"):
        dsa_topk.topk_select(scores, valid[:, :9], 4)


_ENGINE = textwrap.dedent("""
    import sys
    import torch
    from tilepd.engine import KVState, SamplingParams, dsa_topk, fp8_triton, gemv_triton, layers, load_engine, mla_fused, moe, moe_fused
    from tilepd.engine import mla_attention, mla_core_triton, moe_fused_triton, moe_triton
    torch.set_num_threads(1)
    # few programs a launch: the interpreter pays per program
    gemv_triton.TUNE["block_n"], fp8_triton.TUNE["block_n"], moe_triton.TUNE["block_n"] = 256, 128, 64
    moe_fused_triton.TUNE.update(gate_block_e=16, up_block_n=64, up_block_n_fp8=64, down_block_n=64, up_few=0)
    calls = {"topk": 0, "attention": 0, "moe": 0, "core": 0}
    def spy(module, name, key):  # a spy, not a stand-in: counts that the kernel path ran
        real = getattr(module, name)
        def counted(*a, **kw):
            calls[key] += 1
            return real(*a, **kw)
        setattr(module, name, counted)
    spy(dsa_topk, "topk_select", "topk")
    spy(mla_fused, "attention_block", "attention")
    spy(moe_fused, "moe_block", "moe")
    core = bool(mla_core_triton.TUNE["on"])  # TILEPD_MLA_CORE: the persistent core's phases instead of the three launches
    if core:
        spy(mla_core_triton, "attention_core", "core")
    else:
        del calls["core"]
    spans = {"n": 0}  # windows that fit index_topk: the fused path reads DSA's full selection as the dense span
    real_split = mla_attention.split_plan  # split_partials lays its launch out with it, the core its split phase
    def split_spy(*a, **kw):
        spans["n"] += kw.get("lo") is not None
        return real_split(*a, **kw)
    mla_attention.split_plan = split_spy
    # the speed path as compiled.accelerate turns it on for this family (its CUDA-only parts aside)
    layers.ATTENTION_IMPL["mla"] = mla_fused.FUSED_IMPL["attention"] = "triton"
    moe.EXPERT_IMPL["dense"] = moe.ROUTE_IMPL["router"] = moe.BLOCK_IMPL["moe"] = "triton"
    modes = {"eager": (0, False), "graph": (0, True), "mtp": (None, False)}
    path, refs = sys.argv[1], torch.load(sys.argv[2])
    for name, ref in refs.items():
        state = KVState(ref["seq_len"], ref["layers"], ref["indexer"])
        for mode in ref["modes"]:
            spec_tokens, graph = modes[mode]
            eng = load_engine(path, device="cpu", max_seq_len=256, dtype="float32", use_cuda_graph=graph, num_speculative_tokens=spec_tokens)
            if graph:
                eng.graph_step.buckets = [8, 16, 24, 96, 128, 256]  # windows below, at and above index_topk (16)
            mla_fused.prepare_model(eng.model)
            before = dict(calls)
            eng.inject(state)
            got = eng.decode(ref["tokens"][0], len(ref["tokens"]) - 1, SamplingParams(ignore_eos=True), lambda t: None).tokens
            assert all(calls[k] > before[k] for k in calls), (name, mode, "a kernel path did not run", calls, before)
            assert got == ref["tokens"][1:], (name, mode, got, ref["tokens"][1:])
            print(name, mode, "ok", flush=True)
    assert spans["n"] > 0, "no DSA window that fits index_topk went through the dense span"
    print("engine ok")
""")


@pytest.mark.slow
@pytest.mark.parametrize(("model", "core"), [("glm5", False), ("dsv32", False), ("glm5", True)], ids=["glm5", "dsv32", "glm5-core"])
def test_tiny_dsa_model_decodes_hfs_tokens_through_the_kernels(model: str, core: bool, dsa_ref, request: pytest.FixtureRequest,
                                                                repo_root: Path, tmp_path: Path) -> None:
    """HF's prefill state (a short prompt below index_topk, a long one 5x above it; both decodes outgrow it): the speed
    path's kernels under the interpreter (the DSA indexer and top-k, the MLA kernel, the fused attention half-layer,
    the fused MoE block) decode HF's greedy tokens, through the graph step's static body across windows (short prompt),
    the eager step and the MTP speculative step (long prompt). The reference path's parity with HF is test_dsa.py's.
    core: with the persistent attention core (mla_core_triton, TILEPD_MLA_CORE=1; off by default) in place of its three
    launches, graph and eager only (its two-row form is test_mla_core.py's, against the three kernels)."""
    refs = {}
    for prompt, modes in (("short", ["graph"]), ("long", ["eager"] if core else ["eager", "mtp"])):
        ref = dsa_ref(model, prompt)
        refs[f"{model}/{prompt}"] = {"seq_len": ref.state.seq_len, "layers": ref.state.layers, "indexer": ref.state.indexer,
                                     "tokens": ref.tokens[:13], "modes": modes}
    torch.save(refs, tmp_path / "refs.pt")
    r = _interpret(_ENGINE, repo_root, str(request.getfixturevalue(f"tiny_{model}")), str(tmp_path / "refs.pt"),
                   env={"TILEPD_MLA_CORE": "1" if core else "0"})
    assert r.returncode == 0 and "engine ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.skipif(os.environ.get("TILEPD_SKIP_SM90_COMPILE") == "1", reason="TILEPD_SKIP_SM90_COMPILE=1")
def test_fused_finish_compiles_for_sm90_with_its_ticket(monkeypatch: pytest.MonkeyPatch) -> None:
    """dsa_topk.TUNE["fused_finish"]: the refine's row ticket (an acq_rel atomic) and the refined count read past L1, in
    the sm_90 build the interpreter never makes (tests/engine/sm90_compile.py); the finish kernel is not launched."""
    from tests.engine.sm90_compile import compiling, ptxas_info
    from tilepd.engine import dsa_topk

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(dsa_topk.TUNE, "fused_finish", 1)
    t, length = 2, 32768
    hist = dsa_topk.new_hist(t, torch.device("cpu"))
    with compiling() as done:
        dsa_topk.topk_select(torch.zeros(t, length), torch.ones(t, length, dtype=torch.bool), 2048, hist=hist, clean=True)
    assert [d["name"] for d in done] == ["_topk_split_kernel", "_topk_refine_kernel"]
    refine = done[1]
    assert refine["constexprs"]["FINISH"] and refine["constexprs"]["CLEAN"]
    assert "atom.global.gpu.acq_rel.add" in refine["ptx"] and "ld.global.cg" in refine["ptx"], "the ticket or the count's L1 bypass is missing"
    # each block claims its places (slots written, candidates) with one relaxed 64-bit atomic (the first block, loaded
    # beside the histogram, and the loop over the rest: two in the code), and the split adds its histogram without a
    # fence behind its stores: the row ticket is the only acq_rel atomic left
    for d in done:
        atomics = [line.split()[1] if line.lstrip().startswith("@") else line.split()[0] for line in d["ptx"].splitlines()
                   if ".global." in line and ("atom." in line or "red." in line)]
        claims = [a for a in atomics if a == "atom.global.gpu.relaxed.add.u64"]
        assert len(claims) == 2 and not [a for a in atomics if ".u64" in a and a not in claims], (d["name"], atomics)
        assert [a for a in atomics if "acq_rel" in a] == (["atom.global.gpu.acq_rel.add.u32"] if d is refine else []), (d["name"], atomics)
    info = ptxas_info(refine["ptx"])
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info
