"""The MLA layer's small work between its GEMVs, as two Triton kernels (DeepSeek-V3 / GLM-5 family, decode).

Why: around its projections the absorbed-MLA decode layer ran ~20 small launches on the speed path: the latent's
RMSNorm, RoPE on q_pe and k_pe (flip, mul, addcmul each), two cats, the cache write (index_copy), the W_UK product
(cuBLAS), the indexer key's LayerNorm + RoPE + write, the split-KV merge and the W_UV product (cuBLAS), each a few
microseconds plus a launch gap. Here:

  * `prepare` (one launch): per token, programs of up to four roles side by side
      - absorb: q_lat[h, c] = q_nope[h] . W_UK[h, :, c] for a tile of c, and (first tile) RoPE(q_pe[h]) behind it,
        written as the attention kernel's query row [q_lat | q_pe] in the cache dtype (no cat);
      - latent: RMSNorm(c_kv) * kv_a_norm and RoPE(k_pe), stored at the token's cache slot (no cat, no index_copy);
      - index key (DSA layers with an indexer): LayerNorm(wk . h) with bias and RoPE on its first channels, stored
        at the token's slot of the indexer-key cache (dsa_indexer's key kernel, one role here);
      - head weights (DSA past index_topk): the indexer's weights_proj over the normed hidden in fp32, a head a program;
  * `merge_uv` (one launch): the split-KV partials merged by their log-sum-exp (mla_attention's merge), rounded
    to the cache dtype as the merge stores it, and the W_UV product out[h, v] = lat[h] . W_UV[h, v, :] in the same
    program, written as the wo GEMV's input row [T, H * v].

Rounding follows the unfused ops (dtype `act` = the activations'): q_lat and the W_UV product accumulate in fp32
and round once to `act` (cuBLAS); RoPE rounds x * cos, then the addcmul; the latent's RMSNorm rounds the normed
row, then the product with the norm weight; the indexer key stays fp32 until its store (as dsa_indexer's kernel).
Under TRITON_INTERPRET=1 the kernels run on CPU tensors, which is how the CPU tests check them against the
references below (the same ops the model's reference path runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tilepd.engine import pdl
from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
    from tilepd.engine.pdl import prefetch_l2, trigger, wait
    from tilepd.engine.triton_rows import row_rstd
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

# Tiles (env TILEPD_MLA_FUSED_* override them, so bench/mla_fused_gpu.py can sweep on the device): block_c latent
# columns per absorb program (fewer for a smaller power-of-two rank), block_d q_nope channels per absorb loop step,
# block_v W_UV output channels per merge program, chunk_c latent columns per merge loop step, stages: Triton's software
# pipelining of those loops (the next chunk's weights load while this one is summed). Defaults from
# `python bench/mla_fused_gpu.py` on one H200 (2026-12-03, GLM-5.1 shapes, bf16): prepare 7.8 us (W_UK read floor
# 3.1 us) with 64 columns a program against 8.2 with 128; merge + W_UV 6.6 us (W_UV floor 4.1 us) with 256-column
# chunks against 11.3 with 128; deeper pipelining was slower for both. prep_unroll / merge_unroll: the absorb's NOPE
# loop / the merge's RANK loop unrolled (tl.static_range), so every weight tile of a program is loaded before the
# first is summed (one memory round trip instead of 3 or 2). The same bench's sweep (2026-12-03, second run) picked
# the merge unrolled with 128 output channels a program and 8 warps (7.3 -> 7.0 us with 32 splits); the absorb's
# unroll did not win (7.65 vs 7.68 us), so it stays off.
TUNE: dict[str, int] = {
    "block_c": env_int("TILEPD_MLA_FUSED_BLOCK_C", 64),
    "block_d": env_int("TILEPD_MLA_FUSED_BLOCK_D", 64),
    "prep_stages": env_int("TILEPD_MLA_FUSED_PREP_STAGES", 1),
    "prep_warps": env_int("TILEPD_MLA_FUSED_PREP_WARPS", 4),
    "prep_unroll": env_int("TILEPD_MLA_FUSED_PREP_UNROLL", 0),
    "block_v": env_int("TILEPD_MLA_FUSED_BLOCK_V", 128),
    "chunk_c": env_int("TILEPD_MLA_FUSED_CHUNK_C", 256),
    "merge_stages": env_int("TILEPD_MLA_FUSED_MERGE_STAGES", 1),
    "merge_warps": env_int("TILEPD_MLA_FUSED_MERGE_WARPS", 8),
    "merge_unroll": env_int("TILEPD_MLA_FUSED_MERGE_UNROLL", 1),
}


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _partner(offs, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
        """The channel RoPE pairs with each channel of a rope block (GPT-J pairs, or NeoX halves)."""
        if INTERLEAVED:
            return offs ^ 1
        return (offs + ROPE // 2) % ROPE

    @triton.jit
    def _rope_rounded(x_ptr, offs, cos, sin, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr):
        """RoPE of ROPE channels at x_ptr as apply_rope_*: (x * cos) rounded, then + partner * sin, rounded."""
        x = tl.load(x_ptr + offs).to(tl.float32)
        xp = tl.load(x_ptr + _partner(offs, ROPE, INTERLEAVED)).to(tl.float32)
        a = (x * cos).to(ACT).to(tl.float32)
        return (a + xp * sin).to(ACT)

    @triton.jit
    def _absorb_tile(q_head, WUK, h, d0, offs_c, NOPE: tl.constexpr, RANK: tl.constexpr, BLOCK_D: tl.constexpr):
        """sum over BLOCK_D q_nope channels from d0 of q_nope[d] * W_UK[h, d, offs_c] (fp32)."""
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dmask = offs_d < NOPE
        qn = tl.load(q_head + offs_d, mask=dmask, other=0.0).to(tl.float32)
        w = tl.load(WUK + (h * NOPE + offs_d).to(tl.int64)[:, None] * RANK + offs_c[None, :], mask=dmask[:, None], other=0.0)
        return tl.sum(w.to(tl.float32) * qn[:, None], axis=0)

    @triton.jit
    def _prepare_kernel(Q, KV, KX, WUK, KVN, KN, KB, CS, ICS, POS, C, IC, QOUT, X, XN, WP, WOUT, eps, x_eps,
                        s_qt, s_kvt, s_kxt, s_ct, s_c1, s_ict, s_ic1, s_cl, s_icl, s_ot, s_oh, s_xt, s_wp, s_wt,
                        QW, N_ABSORB, HIDDEN, NOPE: tl.constexpr,
                        RANK: tl.constexpr, ROPE: tl.constexpr, IDX_D: tl.constexpr, INTERLEAVED: tl.constexpr,
                        IDX_INTERLEAVED: tl.constexpr, HAS_INDEX: tl.constexpr, HAS_WEIGHTS: tl.constexpr, ACT: tl.constexpr, NOPE_PAD: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                        UNROLL: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
        t = tl.program_id(1)
        pid = tl.program_id(0)
        if PREFETCH:  # before the wait (pdl.py): an absorb program's W_UK tile into L2, a 128-byte line an address
            if pid < N_ABSORB:
                n_pf = RANK // BLOCK_C
                pf_c = (pid % n_pf) * BLOCK_C + tl.arange(0, (BLOCK_C * 2 + 127) // 128) * 64  # 2-byte weights
                pf_d = tl.arange(0, NOPE_PAD)
                prefetch_l2(WUK + ((pid // n_pf) * NOPE + pf_d).to(tl.int64)[:, None] * RANK + pf_c[None, :],
                            (pf_d < NOPE)[:, None] & (pf_c < RANK)[None, :])
        wait(PDL)
        _prepare_item(pid, t, Q, KV, KX, WUK, KVN, KN, KB, CS, ICS, POS, C, IC, QOUT, X, XN, WP, WOUT, eps, x_eps,
                      s_qt, s_kvt, s_kxt, s_ct, s_c1, s_ict, s_ic1, s_cl, s_icl, s_ot, s_oh, s_xt, s_wp, s_wt,
                      QW, N_ABSORB, HIDDEN, NOPE, RANK, ROPE, IDX_D, INTERLEAVED, IDX_INTERLEAVED, HAS_INDEX, HAS_WEIGHTS, ACT,
                      BLOCK_C, BLOCK_D, BLOCK_K, STAGES, UNROLL)
        trigger(PDL)  # pdl.py: the late form triggers here

    @triton.jit
    def _prepare_item(pid, t, Q, KV, KX, WUK, KVN, KN, KB, CS, ICS, POS, C, IC, QOUT, X, XN, WP, WOUT, eps, x_eps,
                      s_qt, s_kvt, s_kxt, s_ct, s_c1, s_ict, s_ic1, s_cl, s_icl, s_ot, s_oh, s_xt, s_wp, s_wt,
                      QW, N_ABSORB, HIDDEN, NOPE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, IDX_D: tl.constexpr,
                      INTERLEAVED: tl.constexpr, IDX_INTERLEAVED: tl.constexpr, HAS_INDEX: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                      ACT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                      UNROLL: tl.constexpr):
        """Program `pid` of token t's prepare (its role: an absorb tile, the latent, the index key or a head weight);
        the prepare kernel runs one a program, the persistent core (mla_core_triton) loops over them."""
        offs_p = tl.arange(0, ROPE)
        cos = tl.load(CS + t * s_ct + offs_p).to(tl.float32)
        sin = tl.load(CS + t * s_ct + s_c1 + offs_p).to(tl.float32)
        slot = tl.load(POS + t).to(tl.int64)
        if pid < N_ABSORB:  # absorb: one head, one tile of latent columns
            n_ct = RANK // BLOCK_C
            h = pid // n_ct
            offs_c = (pid % n_ct) * BLOCK_C + tl.arange(0, BLOCK_C)
            q_head = Q + t * s_qt + h * QW
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            if UNROLL:  # every W_UK tile of the head's NOPE rows in flight at once (one memory round trip)
                for d0 in tl.static_range(0, NOPE, BLOCK_D):
                    acc += _absorb_tile(q_head, WUK, h, d0, offs_c, NOPE, RANK, BLOCK_D)
            else:
                for d0 in tl.range(0, NOPE, BLOCK_D, num_stages=STAGES):
                    acc += _absorb_tile(q_head, WUK, h, d0, offs_c, NOPE, RANK, BLOCK_D)
            out_row = QOUT + t * s_ot + h * s_oh
            tl.store(out_row + offs_c, acc.to(ACT).to(QOUT.dtype.element_ty))
            if pid % n_ct == 0:
                q_pe = _rope_rounded(q_head + NOPE, offs_p, cos, sin, ROPE, INTERLEAVED, ACT)
                tl.store(out_row + RANK + offs_p, q_pe.to(QOUT.dtype.element_ty))
        elif pid == N_ABSORB:  # the token's latent and k_pe into its cache slot
            offs_r = tl.arange(0, RANK)
            c = tl.load(KV + t * s_kvt + offs_r).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(c * c, axis=0) / RANK + eps)
            g = tl.load(KVN + offs_r).to(tl.float32)
            c = ((c * rstd).to(ACT).to(tl.float32) * g).to(ACT)
            row = C + slot * s_cl
            tl.store(row + offs_r, c.to(C.dtype.element_ty))
            k_pe = _rope_rounded(KV + t * s_kvt + RANK, offs_p, cos, sin, ROPE, INTERLEAVED, ACT)
            tl.store(row + RANK + offs_p, k_pe.to(C.dtype.element_ty))
        elif pid == N_ABSORB + 1:  # DSA: the indexer key, LayerNorm (eps 1e-6, bias) + RoPE on its first ROPE channels
            if HAS_INDEX:
                offs = tl.arange(0, IDX_D)
                roped = offs < ROPE
                partner = tl.where(roped, _partner(offs, ROPE, IDX_INTERLEAVED), offs)
                x = tl.load(KX + t * s_kxt + offs).to(tl.float32)
                mean = tl.sum(x, axis=0) / IDX_D
                var = tl.sum((x - mean) * (x - mean), axis=0) / IDX_D
                rstd = 1.0 / tl.sqrt(var + 1e-6)
                y = (x - mean) * rstd * tl.load(KN + offs).to(tl.float32) + tl.load(KB + offs).to(tl.float32)
                xp = tl.load(KX + t * s_kxt + partner).to(tl.float32)
                yp = (xp - mean) * rstd * tl.load(KN + partner).to(tl.float32) + tl.load(KB + partner).to(tl.float32)
                icos = tl.load(ICS + t * s_ict + offs, mask=roped, other=1.0).to(tl.float32)
                isin = tl.load(ICS + t * s_ict + s_ic1 + offs, mask=roped, other=0.0).to(tl.float32)
                tl.store(IC + slot * s_icl + offs, (y * icos + yp * isin).to(IC.dtype.element_ty))
        else:  # DSA scoring: one indexer head's weight, fp32 over the normed hidden (programs past the key's)
            if HAS_WEIGHTS:
                hh = pid - N_ABSORB - 2
                x_row = X + t * s_xt
                rstd = row_rstd(x_row, HIDDEN, x_eps, BLOCK_K)
                acc = tl.zeros([BLOCK_K], dtype=tl.float32)
                for k0 in range(0, HIDDEN, BLOCK_K):
                    kc = k0 + tl.arange(0, BLOCK_K)
                    km = kc < HIDDEN
                    xs = tl.load(x_row + kc, mask=km, other=0.0).to(tl.float32)
                    g = tl.load(XN + kc, mask=km, other=0.0).to(tl.float32)
                    xn = ((xs * rstd).to(ACT).to(tl.float32) * g).to(ACT).to(tl.float32)  # rms_norm(x) as the layer rounds it
                    acc += xn * tl.load(WP + hh * s_wp + kc, mask=km, other=0.0).to(tl.float32)
                tl.store(WOUT + t * s_wt + hh, tl.sum(acc, axis=0))

    @triton.jit
    def _uv_tile(WUV, h, V, c0, offs_v, vmask, RANK: tl.constexpr, CHUNK_C: tl.constexpr):
        """W_UV[h, offs_v, c0:c0+CHUNK_C] (zeros past V)."""
        offs_c = c0 + tl.arange(0, CHUNK_C)
        return tl.load(WUV + (h * V + offs_v).to(tl.int64)[:, None] * RANK + offs_c[None, :], mask=vmask[:, None], other=0.0)

    @triton.jit
    def _merged_latent(o_head, c0, offs_s, smask, wt, den, s_os, ACT: tl.constexpr, LAT: tl.constexpr, CHUNK_C: tl.constexpr):
        """The merged latent's columns c0..c0+CHUNK_C, rounded as the merge stores it (to LAT, then ACT), in fp32."""
        offs_c = c0 + tl.arange(0, CHUNK_C)
        o = tl.load(o_head + offs_s[:, None] * s_os + offs_c[None, :], mask=smask[:, None], other=0.0)
        return (tl.sum(o * wt[:, None], axis=0) / den).to(LAT).to(ACT).to(tl.float32)

    @triton.jit
    def _uv_chunk(o_head, WUV, h, V, c0, offs_s, smask, wt, den, offs_v, vmask, s_os, RANK: tl.constexpr, ACT: tl.constexpr,
                  LAT: tl.constexpr, CHUNK_C: tl.constexpr):
        """W_UV[h, offs_v, c0:c0+CHUNK_C] . the merged latent's columns c0.. (rounded as the merge stores it), fp32."""
        lat = _merged_latent(o_head, c0, offs_s, smask, wt, den, s_os, ACT, LAT, CHUNK_C)
        w = _uv_tile(WUV, h, V, c0, offs_v, vmask, RANK, CHUNK_C)
        return tl.sum(w.to(tl.float32) * lat[None, :], axis=1)

    @triton.jit
    def _lse_weights(LSE, t, h, s_lt, s_lh, S, BLOCK_S: tl.constexpr):
        """The splits' merge weights exp2(lse - max) (0 for a split that saw nothing) and their sum (1 if all did)."""
        offs_s = tl.arange(0, BLOCK_S)
        smask = offs_s < S
        lse = tl.load(LSE + t * s_lt + h * s_lh + offs_s, mask=smask, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        wt = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - mx))
        den = tl.sum(wt, axis=0)
        return offs_s, smask, wt, tl.where(den > 0.0, den, 1.0)

    @triton.jit
    def _merge_uv_kernel(O, LSE, WUV, OUT, S, H, V, s_ot, s_oh, s_os, s_lt, s_lh, s_out,
                         RANK: tl.constexpr, ACT: tl.constexpr, LAT: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_V: tl.constexpr, CHUNK_C: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr,
                         PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
        row = tl.program_id(0)
        if PREFETCH:  # before the wait (pdl.py): the program's W_UV rows into L2, a 128-byte line an address
            offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
            pf_c = tl.arange(0, (RANK * 2 + 127) // 128) * 64  # 2-byte weights
            prefetch_l2(WUV + ((row % H) * V + offs_v).to(tl.int64)[:, None] * RANK + pf_c[None, :],
                        (offs_v < V)[:, None] & (pf_c < RANK)[None, :])
        wait(PDL)
        _merge_uv_item(row, tl.program_id(1), O, LSE, WUV, OUT, S, H, V, s_ot, s_oh, s_os, s_lt, s_lh, s_out,
                       RANK, ACT, LAT, BLOCK_S, BLOCK_V, CHUNK_C, STAGES, UNROLL)
        trigger(PDL)  # pdl.py: the late form triggers here

    @triton.jit
    def _merge_uv_item(row, vb, O, LSE, WUV, OUT, S, H, V, s_ot, s_oh, s_os, s_lt, s_lh, s_out,
                       RANK: tl.constexpr, ACT: tl.constexpr, LAT: tl.constexpr, BLOCK_S: tl.constexpr,
                       BLOCK_V: tl.constexpr, CHUNK_C: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr):
        """Head row (t * H + h)'s output channels vb * BLOCK_V..: the merge kernel runs one a program, the persistent
        core (mla_core_triton) loops over them."""
        t = row // H
        h = row % H
        offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = offs_v < V
        offs_s, smask, wt, den = _lse_weights(LSE, t, h, s_lt, s_lh, S, BLOCK_S)
        acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        o_head = O + t * s_ot + h * s_oh
        if UNROLL:  # every chunk's W_UV tile and partials in flight at once
            for c0 in tl.static_range(0, RANK, CHUNK_C):
                acc += _uv_chunk(o_head, WUV, h, V, c0, offs_s, smask, wt, den, offs_v, vmask, s_os, RANK, ACT, LAT, CHUNK_C)
        else:
            for c0 in tl.range(0, RANK, CHUNK_C, num_stages=STAGES):
                acc += _uv_chunk(o_head, WUV, h, V, c0, offs_s, smask, wt, den, offs_v, vmask, s_os, RANK, ACT, LAT, CHUNK_C)
        tl.store(OUT + t * s_out + h * V + offs_v, acc.to(ACT), mask=vmask)

    @triton.jit
    def _uv_weights(WUV, row, vb, H, V, RANK: tl.constexpr, BLOCK_V: tl.constexpr):
        """Head row's W_UV tile [BLOCK_V, RANK] (zeros past V or for a row past the last): loaded by the persistent core
        before its last grid barrier, since no kernel of the step writes weights."""
        offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        return _uv_tile(WUV, row % H, V, 0, offs_v, offs_v < V, RANK, RANK)

    @triton.jit
    def _merge_uv_loaded(row, vb, w, O, LSE, OUT, S, H, V, s_ot, s_oh, s_os, s_lt, s_lh, s_out, RANK: tl.constexpr, ACT: tl.constexpr,
                         LAT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr):
        """_merge_uv_item with the W_UV tile already loaded (_uv_weights): the partials merged over the whole rank at once."""
        t = row // H
        h = row % H
        offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_s, smask, wt, den = _lse_weights(LSE, t, h, s_lt, s_lh, S, BLOCK_S)
        lat = _merged_latent(O + t * s_ot + h * s_oh, 0, offs_s, smask, wt, den, s_os, ACT, LAT, RANK)
        acc = tl.sum(w.to(tl.float32) * lat[None, :], axis=1)
        tl.store(OUT + t * s_out + h * V + offs_v, acc.to(ACT), mask=offs_v < V)


def _tl(dtype: torch.dtype) -> object:
    """The Triton type of an activation dtype (a kernel's ACT / LAT constexpr)."""
    table = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if dtype not in table:
        raise ValueError(f"MLA fused kernels: {dtype} is not supported (float32, bfloat16, float16)")
    return table[dtype]


@dataclass
class Plan:
    """One launch's work laid out: its outputs, grid and arguments in the kernel's order (args: tensors, scalars and
    strides; constexprs: the tiles)."""

    outputs: tuple
    grid: tuple[int, int]
    args: tuple
    constexprs: dict

    @property
    def items(self) -> int:
        return self.grid[0] * self.grid[1]


def prepare_plan(q: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor, kv_norm: torch.Tensor, eps: float, cs: torch.Tensor,
                 positions: torch.Tensor, cache: torch.Tensor, rank: int, rope: int, interleaved: bool,
                 index: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool] | None = None,
                 head_weights: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None,
                 block_c: int | None = None, unroll: bool | None = None) -> Plan:
    """prepare's layout without the launch (outputs: qout, wout); block_c / unroll: the absorb tile instead of TUNE's
    (the persistent core, mla_core_triton, runs the same items with its own)."""
    if triton is None:
        raise RuntimeError("MLA fused kernels need Triton, which is not importable here")
    t = q.shape[0]
    h, nope, r = w_uk.shape
    rows = cache.reshape(cache.shape[0], -1)
    block_c = min(block_c or TUNE["block_c"], rank)
    if r != rank or rank % block_c or rope & (rope - 1) or q.shape[1] != h * (nope + rope) or kv.shape[1] != rank + rope \
            or rows.shape[1] != rank + rope:
        raise ValueError(f"MLA prepare: q {list(q.shape)}, kv {list(kv.shape)}, W_UK {list(w_uk.shape)}, cache {list(cache.shape)} "
                         f"do not fit rank {rank} (a power of two) and rope {rope} (a power of two)")
    if any(a.stride(-1) != 1 for a in (q, kv, w_uk, rows, cs)) or not w_uk.is_contiguous():
        raise ValueError("MLA prepare: q, kv, W_UK, the cache rows and the rope table must be contiguous along their last dim")
    qout = torch.empty(t, h, rank + rope, dtype=cache.dtype, device=q.device)
    if index is not None:
        kx, kn, kb, ics, icache, idx_interleaved = index
        idx_d = kx.shape[1]
        if icache.shape[1] != idx_d or icache.stride(1) != 1 or kx.stride(1) != 1 or ics.stride(2) != 1 or idx_d & (idx_d - 1):
            raise ValueError(f"MLA prepare: index keys {list(kx.shape)}, cache {list(icache.shape)}: need a power-of-two width, "
                             "contiguous rows")
    else:
        kx, kn, kb, ics, icache, idx_interleaved, idx_d = kv, kv_norm, kv_norm, cs, rows, interleaved, 16
    wout = None
    if head_weights is not None:
        if index is None:
            raise ValueError("MLA prepare: the indexer's head weights come with its key (index)")
        x, xn, x_eps, wp = head_weights
        if x.shape[0] != t or wp.shape[1] != x.shape[1] or x.stride(-1) != 1 or wp.stride(-1) != 1:
            raise ValueError(f"MLA prepare: hidden {list(x.shape)} and weights_proj {list(wp.shape)} do not fit")
        wout = torch.empty(t, wp.shape[0], dtype=torch.float32, device=q.device)
        n_heads, hidden = wp.shape[0], x.shape[1]
    else:
        x, xn, x_eps, wp, n_heads, hidden = q, kv_norm, 0.0, q, 0, 1
    n_absorb = h * (rank // block_c)
    args = (q, kv, kx, w_uk, kv_norm, kn, kb, cs, ics, positions, rows, icache, qout, x, xn, wp, wout if wout is not None else qout, eps, x_eps,
            q.stride(0), kv.stride(0), kx.stride(0), cs.stride(0), cs.stride(1), ics.stride(0), ics.stride(1), rows.stride(0),
            icache.stride(0), qout.stride(0), qout.stride(1), x.stride(0), wp.stride(0), wout.stride(0) if wout is not None else 0,
            nope + rope, n_absorb, hidden)
    constexprs = {"NOPE": nope, "RANK": rank, "ROPE": rope, "IDX_D": idx_d, "INTERLEAVED": interleaved, "IDX_INTERLEAVED": idx_interleaved,
                  "HAS_INDEX": index is not None, "HAS_WEIGHTS": wout is not None, "ACT": _tl(q.dtype), "BLOCK_C": block_c,
                  "BLOCK_D": TUNE["block_d"], "BLOCK_K": 1024, "STAGES": TUNE["prep_stages"],
                  "UNROLL": bool(TUNE["prep_unroll"] if unroll is None else unroll)}
    return Plan((qout, wout), (n_absorb + 1 + (index is not None) + n_heads, t), args, constexprs)


def prepare(q: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor, kv_norm: torch.Tensor, eps: float, cs: torch.Tensor,
            positions: torch.Tensor, cache: torch.Tensor, rank: int, rope: int, interleaved: bool,
            index: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool] | None = None,
            head_weights: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch: the attention query [T, H, rank + rope] (q_lat | roped q_pe, cache dtype), the tokens' cache rows,
    (index given) their indexer keys, and (head_weights given) the indexer's head weights [T, heads] float32.

    q [T, H * (nope + rope)] (wq_b's output); kv [T, rank + rope] (wkv_a's output, may be a strided view); w_uk
    [H, nope, rank]; cs [T, 2, rope] the rope table at the tokens' positions; cache [max_seq_len, 1, rank + rope].
    index = (kx [T, D] wk's output, LayerNorm weight, bias, indexer cs [T, 2, rope], indexer-key cache
    [max_seq_len, D], interleaved). head_weights = (x [T, hidden] the layer's input, its attn_norm weight and eps,
    weights_proj [heads, hidden]): weights_proj(rms_norm(x).float()) as HF computes it (one program a head)."""
    plan = prepare_plan(q, kv, w_uk, kv_norm, eps, cs, positions, cache, rank, rope, interleaved, index, head_weights)
    _prepare_kernel[plan.grid](*plan.args, **plan.constexprs, NOPE_PAD=triton.next_power_of_2(plan.constexprs["NOPE"]),
                               PREFETCH=pdl.prefetch_flag(q, "prepare") and w_uk.element_size() == 2, num_warps=TUNE["prep_warps"],
                               **pdl.launch_args(q, "prepare"))
    return plan.outputs


def merge_plan(part: torch.Tensor, lse: torch.Tensor, w_uv: torch.Tensor, act: torch.dtype, lat: torch.dtype,
               block_v: int | None = None) -> Plan:
    """merge_uv's layout without the launch (outputs: out); block_v: the output channels an item, instead of TUNE's."""
    if triton is None:
        raise RuntimeError("MLA fused kernels need Triton, which is not importable here")
    t, h, s, rank = part.shape
    v = w_uv.shape[1]
    chunk_c = min(TUNE["chunk_c"], rank)
    if tuple(w_uv.shape) != (h, v, rank) or not w_uv.is_contiguous() or part.stride(-1) != 1 or rank % chunk_c:
        raise ValueError(f"MLA merge_uv: partials {list(part.shape)}, W_UV {list(w_uv.shape)} (contiguous, rank a power of two)")
    out = torch.empty(t, h * v, dtype=act, device=part.device)
    block_v = block_v or TUNE["block_v"]
    args = (part, lse, w_uv, out, s, h, v, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0))
    constexprs = {"RANK": rank, "ACT": _tl(act), "LAT": _tl(lat), "BLOCK_S": max(2, triton.next_power_of_2(s)), "BLOCK_V": block_v,
                  "CHUNK_C": chunk_c, "STAGES": TUNE["merge_stages"], "UNROLL": bool(TUNE["merge_unroll"])}
    return Plan((out,), (t * h, triton.cdiv(v, block_v)), args, constexprs)


def merge_uv(part: torch.Tensor, lse: torch.Tensor, w_uv: torch.Tensor, act: torch.dtype, lat: torch.dtype) -> torch.Tensor:
    """The split-KV partials part [T, H, S, rank] (fp32) and lse [T, H, S] (log2 units) merged, rounded to `lat`
    (the cache dtype, as the merge stores it) and to `act`, times W_UV [H, v, rank]: [T, H * v] in `act`."""
    plan = merge_plan(part, lse, w_uv, act, lat)
    _merge_uv_kernel[plan.grid](*plan.args, **plan.constexprs, PREFETCH=pdl.prefetch_flag(part, "merge") and w_uv.element_size() == 2,
                                num_warps=TUNE["merge_warps"], **pdl.launch_args(part, "merge"))
    return plan.outputs[0]


# -- the references: the model's own ops (deepseek_v3._attention, dsa.indexer_key), for the tests ------------------

def prepare_reference(q: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor, kv_norm: torch.Tensor, eps: float, cs: torch.Tensor,
                      positions: torch.Tensor, cache: torch.Tensor, rank: int, rope: int, interleaved: bool,
                      index: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool] | None = None,
                      head_weights: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    from tilepd.engine.norm_act import rms_norm
    from tilepd.engine.rope import apply_rope_interleaved, apply_rope_neox

    rope_fn = apply_rope_interleaved if interleaved else apply_rope_neox
    t = q.shape[0]
    h, nope, _ = w_uk.shape
    q_nope, q_pe = q.view(t, h, -1).split([nope, rope], dim=-1)
    latent, k_pe = kv.split([rank, rope], dim=-1)
    latent = rms_norm(latent, kv_norm, eps)
    k_pe = rope_fn(k_pe.reshape(t, 1, rope), cs)
    cache.index_copy_(0, positions, torch.cat([latent.view(t, 1, rank), k_pe], dim=-1).to(cache.dtype))
    if index is not None:
        kx, kn, kb, ics, icache, idx_interleaved = index
        d = kx.shape[1]
        k = F.layer_norm(kx, (d,), kn, kb, 1e-6).view(t, 1, d)
        idx_fn = apply_rope_interleaved if idx_interleaved else apply_rope_neox
        k = torch.cat([idx_fn(k[..., :rope].contiguous(), ics), k[..., rope:]], dim=-1)
        icache.index_copy_(0, positions, k.view(t, d).to(icache.dtype))
    q_lat = torch.einsum("thd,hdc->thc", q_nope, w_uk)
    wout = None
    if head_weights is not None:
        x, xn, x_eps, wp = head_weights
        wout = F.linear(rms_norm(x, xn, x_eps).float(), wp.float())
    return torch.cat([q_lat, rope_fn(q_pe, cs)], dim=-1).to(cache.dtype), wout


def merge_uv_reference(part: torch.Tensor, lse: torch.Tensor, w_uv: torch.Tensor, act: torch.dtype, lat: torch.dtype) -> torch.Tensor:
    t, h = part.shape[:2]
    finite = torch.isfinite(lse)
    mx = torch.where(finite, lse, torch.full_like(lse, float("-inf"))).amax(dim=-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    wt = torch.where(finite, torch.exp2(lse - mx), torch.zeros_like(lse))
    den = wt.sum(dim=-1, keepdim=True)
    merged = (part * wt[..., None]).sum(dim=2) / torch.where(den > 0, den, torch.ones_like(den))
    out = torch.einsum("thc,hvc->thv", merged.to(lat).to(act), w_uv)
    return out.reshape(t, -1)
