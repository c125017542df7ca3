"""The DeepSeek-family attention half-layer on the speed path in 5-6 launches (7 + the top-k's with DSA's scoring).

x -> x + wo(W_UV(attention(q, cache))), with the norms, RoPE, the cache writes, W_UK and W_UV folded into the
launches that read the weights anyway:

  1. G1: rms_norm(x) * attn_norm in the prologue of one GEMV over [wq_a | idx_wk | wkv_a] (the projections of the
     normed hidden, concatenated once at load; a part in another weight format gets its own launch);
  2. G2 (q_lora models): rms_norm(q_a) * q_a_norm in the prologue of one GEMV over [wq_b | idx_wq_b]; while the
     cache window fits DSA's index_topk the indexer's query rows are not needed (every causal slot is selected)
     and only the wq_b prefix is computed;
  3. prepare (mla_fused_triton): q_lat = q_nope . W_UK with RoPE(q_pe) behind it, the latent's norm + RoPE(k_pe)
     into the cache, the indexer key into its cache;
  4. DSA past index_topk only: the indexer's scores (dsa_indexer) and top-k (dsa_topk); its head weights are one
     more role of prepare;
  5. split-KV MLA attention (mla_attention's split kernel): DSA's selection past index_topk, else the dense span
     (a DSA window that fits index_topk selects every causal slot: the span is that selection, read without indices);
  6. merge + W_UV in one launch (mla_fused_triton.merge_uv);
  7. wo with the residual add in its epilogue.
With mla_core_triton's switch on, 3, 5 and 6 are one persistent launch (5 and 6 where DSA scores between 3 and 5).

The weights of G1 and G2 are concatenated once (`prepare_model`, called by compiled.accelerate before the first
graph capture); the model's own entries (wq_a, wkv_a, ...) become views into them, so memory does not grow and the
reference path still finds its weights. `FUSED_IMPL` is the switch (compiled.accelerate turns it on and GraphStep
can turn it off again if a capture fails).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tilepd.engine.dsa import DSAStep
from tilepd.model_format.block_fp8 import BlockFp8
from tilepd.model_format.model_spec import ModelSpec


@dataclass
class DenseSpan:
    """Dense MLA mask for the kernel: token t sees slots lo[t]..hi[t] (device tensors) of a window of `length`."""

    lo: torch.Tensor
    hi: torch.Tensor
    length: int


class MlaModel(Protocol):
    """What the fused block reads of a DeepSeek-family model (deepseek_v3.DeepseekV3Model and its TP subclass)."""

    spec: ModelSpec
    w: dict
    fused: dict
    mtp_caches: list[torch.Tensor]
    index_caches: dict[str, torch.Tensor]
    rope: torch.Tensor
    index_rope: torch.Tensor
    scale: float

    def _mla_kernel(self, x: torch.Tensor) -> bool: ...

# "torch": the model's own ops (deepseek_v3._attention); "triton": this module (CUDA, or CPU under TRITON_INTERPRET=1),
# set by compiled.accelerate(mla_fused=True).
FUSED_IMPL = {"attention": "torch"}

MAX_TOKENS = 8  # rows a step may have on this path (the GEMV kernels' bound; MTP verifies k+1 <= 8)

_A_PARTS = ("wq_a", "wq", "idx_wk", "wkv_a")  # projections of the normed hidden, in concatenation order
_B_PARTS = ("wq_b", "idx_wq_b")  # projections of the normed q_a


@dataclass
class Group:
    """One GEMV launch: a weight whose rows are the named parts, in order."""

    weight: torch.Tensor | BlockFp8
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)

    def rows_for(self, names: set[str]) -> int:
        """Rows to compute so that every part in `names` is covered (a prefix: later parts may be skipped)."""
        return max((end for name, (_, end) in self.parts.items() if name in names), default=0)


@dataclass
class FusedLayer:
    a_groups: list[Group]
    b_groups: list[Group]


def _format_key(w: torch.Tensor | BlockFp8) -> tuple:
    if isinstance(w, BlockFp8):
        return ("fp8", w.block[1], w.weight.shape[-1], w.weight.device)
    return ("dense", w.dtype, w.shape[-1], w.device)


def _concat(parts: list[tuple[str, torch.Tensor | BlockFp8]]) -> tuple[Group, dict[str, torch.Tensor | BlockFp8]]:
    """One weight over the parts' rows, and each part's view into it (what replaces the model's entry)."""
    spans, start = {}, 0
    for name, w in parts:
        rows = w.shape[-2]
        spans[name] = (start, start + rows)
        start += rows
    first = parts[0][1]
    if not isinstance(first, BlockFp8):
        cat = torch.cat([w for _, w in parts], dim=0).contiguous()
        return Group(cat, spans), {name: cat[a:b] for name, (a, b) in spans.items()}
    bn, bk = first.block
    aligned = all(w.block == first.block for _, w in parts) and all(w.shape[-2] % bn == 0 for _, w in parts[:-1])
    if aligned:
        cat = BlockFp8(torch.cat([w.weight for _, w in parts]).contiguous(), torch.cat([w.scale for _, w in parts]).contiguous(), (bn, bk))
        views = {name: BlockFp8(cat.weight[a:b], cat.scale[a // bn: -(-b // bn)], (bn, bk)) for name, (a, b) in spans.items()}
        return Group(cat, spans), views
    # rows off the block grid: one scale per row instead (block_n 1; the same values and scales, as fp8.py allows)
    per_row = [w.scale.repeat_interleave(w.block[0], dim=0)[: w.shape[-2]] for _, w in parts]
    cat = BlockFp8(torch.cat([w.weight for _, w in parts]).contiguous(), torch.cat(per_row).contiguous(), (1, bk))
    views = {name: BlockFp8(cat.weight[a:b], cat.scale[a:b], (1, bk)) for name, (a, b) in spans.items()}
    return Group(cat, spans), views


def _groups(w: dict, p: str, names: tuple[str, ...], built: dict) -> list[Group]:
    """Consecutive parts of one weight format share a launch; the model's entries are replaced by views."""
    present = [(n, w[p + n]) for n in names if p + n in w]
    runs: list[list[tuple[str, torch.Tensor | BlockFp8]]] = []
    for name, weight in present:
        if runs and _format_key(runs[-1][-1][1]) == _format_key(weight):
            runs[-1].append((name, weight))
        else:
            runs.append([(name, weight)])
    groups = []
    for run in runs:
        key = tuple(id(weight) for _, weight in run)  # layers that alias one tensor (benches) share the concatenation
        if key not in built:
            built[key] = _concat(run) if len(run) > 1 else (Group(run[0][1], {run[0][0]: (0, run[0][1].shape[-2])}), {})
        group, views = built[key]
        for name, view in views.items():
            w[p + name] = view
        groups.append(group)
    return groups


def prepare_model(model: MlaModel) -> None:
    """Concatenate each layer's projections for G1 and G2 (main layers and MTP layers). Call outside any graph capture."""
    s, w = model.spec, model.w
    prefixes = [f"layers.{i}." for i in range(s.num_layers)] + [f"mtp.{k}." for k in range(len(model.mtp_caches))]
    built: dict = {}
    fused = {}
    for p in prefixes:
        if p + "wkv_a" not in w:
            continue
        fused[p] = FusedLayer(_groups(w, p, _A_PARTS, built), _groups(w, p, _B_PARTS, built))
    model.fused = fused


def _kernels_available() -> bool:
    from tilepd.engine import fp8_triton, gemv_triton, mla_fused_triton

    return mla_fused_triton.available() and fp8_triton.available() and gemv_triton.available()


def applies(model: MlaModel, p: str, x: torch.Tensor) -> bool:
    """This step's layer `p` runs here: switch on, the MLA kernel path in use, few enough rows, weights prepared."""
    if FUSED_IMPL["attention"] != "triton" or x.shape[0] > MAX_TOKENS or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if not model._mla_kernel(x):  # power-of-two latent and rope widths
        return False
    if p not in getattr(model, "fused", {}):
        return False
    return _kernels_available()


def gemv(x: torch.Tensor, weight: torch.Tensor | BlockFp8, rows: int, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         residual: torch.Tensor | None = None, site: str = "gemv") -> torch.Tensor:
    """(residual +) weight[:rows] @ (rms_norm(x) * norm_weight | x), one launch (fp8: fp8_triton; dense: gemv_triton);
    site: the launch's PDL site (pdl.SITES: g1, g2, wo)."""
    if isinstance(weight, BlockFp8):
        from tilepd.engine import fp8_triton

        bn = weight.block[0]
        return fp8_triton.launch_fused(x, weight.weight[:rows], weight.scale[: -(-rows // bn)], weight.block,
                                       norm_weight=norm_weight, eps=eps, residual=residual, site=site)
    from tilepd.engine import gemv_triton

    return gemv_triton.launch(x, weight[:rows], norm_weight, eps, "norm" if norm_weight is not None else "none", residual, chain=True,
                              site=site)


def _run(groups: list[Group], x: torch.Tensor, need: set[str], norm_weight: torch.Tensor, eps: float, site: str) -> dict[str, torch.Tensor]:
    """Each group's launch over the rows `need` asks for; the named parts as column views of the outputs."""
    out: dict[str, torch.Tensor] = {}
    for g in groups:
        rows = g.rows_for(need)
        if rows == 0:
            continue
        y = gemv(x, g.weight, rows, norm_weight, eps, site=site)
        for name, (a, b) in g.parts.items():
            if b <= rows:
                out[name] = y[:, a:b]
    return out


def attention_block(model: MlaModel, p: str, cache: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                    cs: torch.Tensor, mask: DenseSpan | None, dsa: DSAStep | None, residual: bool = True) -> torch.Tensor:
    """x + attention(rms_norm(x)) for layer `p` (residual False: the attention output alone, which tensor parallelism
    all-reduces before its own add)."""
    from tilepd.engine import mla_core_triton
    from tilepd.engine.dsa import Selection
    from tilepd.engine.mla_attention import TUNE_SPARSE, split_partials, split_plan
    from tilepd.engine.mla_fused_triton import merge_uv, prepare, prepare_plan

    s, w, layer = model.spec, model.w, model.fused[p]
    t, r, rope, eps = x.shape[0], s.kv_lora_rank, s.qk_rope_head_dim, s.rms_norm_eps
    keys = model.index_caches.get(p) if dsa is not None else None
    scoring = keys is not None and dsa.valid.shape[1] > s.index_topk  # past index_topk the indexer must choose
    need_a = {"wq_a", "wq", "wkv_a"} | ({"idx_wk"} if keys is not None else set())
    a = _run(layer.a_groups, x, need_a, w[p + "attn_norm"], eps, "g1")
    b = _run(layer.b_groups, a["wq_a"], {"wq_b"} | ({"idx_wq_b"} if scoring else set()), w[p + "q_a_norm"], eps, "g2") if s.q_lora_rank else {}
    q = b["wq_b"] if s.q_lora_rank else a["wq"]
    index = None
    if keys is not None:
        idx_cs = cs if model.index_rope is model.rope else model.index_rope.index_select(0, positions)
        index = (a["idx_wk"], w[p + "idx_k_norm"], w[p + "idx_k_norm_bias"], idx_cs, keys, s.indexer_rope_interleave)
    head_weights = (x, w[p + "attn_norm"], eps, w[p + "idx_weights_proj"]) if scoring else None
    core = mla_core_triton.enabled(x)  # prepare, split and merge + W_UV in one launch (prepare apart where DSA scores)
    prep = None
    prep_args = (q, a["wkv_a"], w[p + "w_uk"], w[p + "kv_a_norm"], eps, cs, positions, cache, r, rope, s.rope_interleave, index, head_weights)
    if core and not scoring:
        prep = prepare_plan(*prep_args, block_c=mla_core_triton.TUNE["block_c"], unroll=bool(mla_core_triton.TUNE["prep_unroll"]))
        q_cat, weights = prep.outputs
    else:
        q_cat, weights = prepare(*prep_args)
    fits = dsa is not None and dsa.valid.shape[1] <= s.index_topk and isinstance(mask, DenseSpan)
    if dsa is not None and not fits:
        if scoring:
            from tilepd.engine.dsa_indexer import index_topk

            nh, d = s.index_n_heads, s.index_head_dim
            dsa.selection = Selection(*index_topk(b["idx_wq_b"].view(t, nh, d), idx_cs, weights, keys, dsa.valid, rope,
                                                  s.indexer_rope_interleave, min(s.index_topk, dsa.valid.shape[1])))
        elif dsa.selection is None:  # the window fits index_topk but no span came: every causal slot, by index
            length = dsa.valid.shape[1]
            dsa.selection = Selection(torch.arange(length, device=x.device).expand(t, length).contiguous(), dsa.valid.contiguous())
        sel = dsa.selection
        span = {"length": sel.idx.shape[1], "idx": sel.idx, "ok": sel.ok}
    else:  # dense MLA, or DSA while the window fits index_topk: every causal slot is selected, so the span is the
        # selection and the kernel reads rows by position (no index/ok loads in front of each row gather)
        if mask is None:
            raise ValueError("MLA fused attention: a dense layer needs its DenseSpan")
        span = {"length": mask.length, "lo": mask.lo, "hi": mask.hi, "tune": TUNE_SPARSE if fits else None}
    if core:
        out = mla_core_triton.attention_core(prep, split_plan(q_cat, cache, r, model.scale, **span), w[p + "w_uv"], x.dtype, cache.dtype)
    else:
        part, lse = split_partials(q_cat, cache, r, model.scale, **span)
        out = merge_uv(part, lse, w[p + "w_uv"], x.dtype, cache.dtype)
    wo = w[p + "wo"]
    return gemv(out, wo, wo.shape[-2], residual=x if residual else None, site="wo")
