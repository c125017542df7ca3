"""GPU parity (marker gpu) of the persistent MLA attention core's one launch (mla_core_triton: its grid barrier runs only
on a GPU) against the three kernels it replaces, at GLM-5.1's shapes in bf16.

Forms: 1K (prepare in the core, the split over the window's span: two barriers) and past index_topk (2048 selected of
a 32K window, prepare apart: one barrier), one token and two (MTP's verify rows); each run 30 times eagerly (a race at
a barrier would show in some run as rows that differ) and 30 replays of one CUDA graph (the barrier's counter keeps
growing across replays). The cache rows and the query rows must be equal, the outputs within bf16's rounding of the
three kernels' (the merge sums the rank in another order). Test_dsa_gpu_parity / test_mla_gpu_parity run the core
inside the whole step when TILEPD_MLA_CORE=1 (bench/depth_step.sh's `ab` part passes it to its parity step).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

RUNS = 30


def _inputs(t: int, form: str, g: torch.Generator) -> dict:
    dev, bf = "cuda", torch.bfloat16
    heads, nope, rank, rope, v = 64, 192, 512, 64, 256
    slots = 33040 if form == "sparse" else 1296
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dev, bf)  # noqa: E731
    positions = torch.arange(1024 - t, 1024, device=dev)
    d = {"cs": r(t, 2, rope), "positions": positions, "cache": r(slots, 1, rank + rope), "w_uv": r(heads, v, rank, s=0.05),
         "q": r(t, heads * (nope + rope)), "kv": r(t, rank + rope), "w_uk": r(heads, nope, rank, s=0.05), "kvn": r(rank, s=0.1) + 1,
         "rank": rank, "rope": rope}
    if form == "sparse":
        d["span"] = {"length": 2048, "idx": torch.stack([torch.randperm(slots, generator=g)[:2048] for _ in range(t)]).to(dev),
                     "ok": torch.ones(t, 2048, dtype=torch.bool, device=dev)}
    else:
        d["span"] = {"length": slots, "lo": torch.zeros(t, dtype=torch.int64, device=dev), "hi": positions}
    return d


def _separate(d: dict, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from tilepd.engine import mla_attention as A, mla_fused_triton as M

    q, _ = M.prepare(d["q"], d["kv"], d["w_uk"], d["kvn"], 1e-6, d["cs"], d["positions"], cache, d["rank"], d["rope"], True)
    part, lse = A.split_partials(q, cache, d["rank"], 0.07, **d["span"])
    return q, M.merge_uv(part, lse, d["w_uv"], torch.bfloat16, torch.bfloat16)


def _core(d: dict, cache: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    from tilepd.engine import mla_attention as A, mla_core_triton as K, mla_fused_triton as M

    args = (d["q"], d["kv"], d["w_uk"], d["kvn"], 1e-6, d["cs"], d["positions"], cache, d["rank"], d["rope"], True)
    if form == "sparse":  # past index_topk: prepare is a launch of its own, the indexer's between it and the core
        q, _ = M.prepare(*args)
        prep = None
    else:
        prep = M.prepare_plan(*args, block_c=K.TUNE["block_c"], unroll=bool(K.TUNE["prep_unroll"]))
        q = prep.outputs[0]
    return q, K.attention_core(prep, A.split_plan(q, cache, d["rank"], 0.07, **d["span"]), d["w_uv"], torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("form", ["dense", "sparse"])
def test_core_matches_the_three_kernels_eagerly_and_in_a_graph(form: str, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    d = _inputs(t, form, g)
    ref_cache = d["cache"].clone()
    want_q, want = _separate(d, ref_cache)
    tol = 2e-2 * float(want.float().abs().max())

    def check(q: torch.Tensor, out: torch.Tensor, cache: torch.Tensor, where: str) -> None:
        assert torch.equal(cache, ref_cache), (form, t, where, "cache rows")
        q_err = float((q.float() - want_q.float()).abs().max() / want_q.float().abs().max())  # the absorb's tile sums in its own order
        assert q_err <= 1e-2, (form, t, where, "query rows", q_err)
        err = float((out.float() - want.float()).abs().max())
        assert err <= tol, (form, t, where, err, tol)

    for i in range(RUNS):
        cache = d["cache"].clone()
        q, out = _core(d, cache, form)
        torch.cuda.synchronize()
        check(q, out, cache, f"eager run {i}")
    cache = d["cache"].clone()
    _core(d, cache, form)  # warm up (builds, and makes the barrier's counter uncaptured)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, out = _core(d, cache, form)
    for i in range(RUNS):
        cache.copy_(d["cache"])
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        check(q, out, cache, f"replay {i}")
