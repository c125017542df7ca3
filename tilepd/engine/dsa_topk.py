"""DSA's top-k over the indexer scores in one Triton launch: a radix select, no sort.

Why: torch.topk(k=2048) over a [T, L] row costs a radix sort (L <= k) or several gatherTopK passes per layer
(the issue 24 profile: ~50 us a layer of topk kernels at 1K). The MLA kernel does not care about the order of
the selected slots, so only the SET of the k best is needed, which a radix select finds in O(L).

One program per query row (T is 1..4 at decode), as vLLM's top_k_per_row does. Scores are mapped to int32
keys that order like the floats; the select takes 11 + 11 + 10 bits of the key in three histogram passes:
  1. histogram of the top 11 bits over the row: the bin b1 holding the k-th best, and how many lie above it;
  2. over the row again: slots above b1 are written out (they are in whatever the lower bits say), the slots
     in b1 (the candidates, usually a small fraction of L) are compacted into a scratch buffer, with the
     histogram of their next 11 bits;
  3. over the candidates only: the last 10 bits, giving the k-th best key exactly and how many ties at it
     are still needed; a last pass over the candidates writes those above it and the first ties at it.
So the row is read twice whatever k and L are, and the output always holds exactly k slots (L >= k).
Ties at the k-th value are taken in slot order; torch.topk may take others of equal value (same values).
Static shapes, no host sync: CUDA-graph safe. The reference is torch.topk (dsa.select_topk's portable path).
"""

from __future__ import annotations

import torch

from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

# block: scores per loop iteration; num_warps: the one program's width (a row is read by one SM, so it
# wants many loads in flight).
TUNE: dict[str, int] = {
    "block": env_int("TILEPD_DSA_TOPK_BLOCK", 4096),
    "num_warps": env_int("TILEPD_DSA_TOPK_NUM_WARPS", 16),
}


if triton is not None:

    @triton.jit
    def _ordered_key(x):
        """int32 key with the floats' order (signed compare): negative floats get their magnitude bits flipped."""
        i = x.to(tl.int32, bitcast=True)
        return i ^ ((i >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _find_bin(h, k_rem, NB: tl.constexpr):
        """The highest bin j with at least k_rem elements at or above it; the count strictly above j, and in j."""
        bins = tl.arange(0, NB)
        at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
        j = tl.max(tl.where(at_or_above >= k_rem, bins, 0), axis=0)
        above = tl.sum(tl.where(bins == j, at_or_above - h, 0), axis=0)
        inside = tl.sum(tl.where(bins == j, h, 0), axis=0)
        return j, above, inside

    @triton.jit
    def _masked_hist(digit, m, NB: tl.constexpr, BLOCK: tl.constexpr):
        """Histogram of digit where m (masked lanes are counted in bin 0, then taken out again)."""
        h = tl.histogram(tl.where(m, digit, 0), NB)
        n_off = BLOCK - tl.sum(m.to(tl.int32), axis=0)
        return h - tl.where(tl.arange(0, NB) == 0, n_off, 0)

    @triton.jit
    def _topk_select_kernel(S, VALID, IDX, OK, CAND_K, CAND_I, L, K, s_st, s_vt, s_it, s_ct, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        row = S + t * s_st
        vrow = VALID + t * s_vt
        orow_i = IDX + t * s_it
        orow_ok = OK + t * s_it
        crow_k = CAND_K + t * s_ct
        crow_i = CAND_I + t * s_ct
        offs = tl.arange(0, BLOCK)
        # 1. top 11 bits over the row
        h1 = tl.zeros([2048], tl.int32)
        for n0 in range(0, L, BLOCK):
            o = n0 + offs
            m = o < L
            key = _ordered_key(tl.load(row + o, mask=m, other=0.0))
            h1 += _masked_hist(((key >> 21) + 1024) & 2047, m, 2048, BLOCK)
        j1, above1, n_cand = _find_bin(h1, K, 2048)
        k_rem = K - above1
        p1 = j1 - 1024  # the candidates' key >> 21
        # 2. write the slots above bin j1, compact bin j1 into the scratch, histogram its next 11 bits
        h2 = tl.zeros([2048], tl.int32)
        n_out = tl.zeros([], tl.int32)
        n_in = tl.zeros([], tl.int32)
        for n0 in range(0, L, BLOCK):
            o = n0 + offs
            m = o < L
            key = _ordered_key(tl.load(row + o, mask=m, other=0.0))
            top = key >> 21
            take = m & (top > p1)
            pos = n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1
            ok = tl.load(vrow + o, mask=take, other=0)
            tl.store(orow_i + pos, o.to(tl.int64), mask=take)
            tl.store(orow_ok + pos, ok, mask=take)
            n_out += tl.sum(take.to(tl.int32), axis=0)
            cand = m & (top == p1)
            cpos = n_in + tl.cumsum(cand.to(tl.int32), axis=0) - 1
            tl.store(crow_k + cpos, key, mask=cand)
            tl.store(crow_i + cpos, o, mask=cand)
            n_in += tl.sum(cand.to(tl.int32), axis=0)
            h2 += _masked_hist((key >> 10) & 2047, cand, 2048, BLOCK)
        tl.debug_barrier()  # the candidates written above are read back by other threads below
        j2, above2, _ = _find_bin(h2, k_rem, 2048)
        k_rem = k_rem - above2
        p12 = p1 * 2048 + j2  # the remaining candidates' key >> 10
        # 3. the last 10 bits over the candidates
        h3 = tl.zeros([1024], tl.int32)
        for n0 in range(0, n_cand, BLOCK):
            o = n0 + offs
            m = o < n_cand
            key = tl.load(crow_k + o, mask=m, other=0)
            h3 += _masked_hist(key & 1023, m & ((key >> 10) == p12), 1024, BLOCK)
        j3, above3, _ = _find_bin(h3, k_rem, 1024)
        ties = k_rem - above3  # how many slots equal to the k-th key are still needed
        kth = p12 * 1024 + j3
        # 4. candidates above the k-th key, then the first `ties` equal to it
        n_tie = tl.zeros([], tl.int32)
        for n0 in range(0, n_cand, BLOCK):
            o = n0 + offs
            m = o < n_cand
            key = tl.load(crow_k + o, mask=m, other=0)
            eq = m & (key == kth)
            tie_rank = n_tie + tl.cumsum(eq.to(tl.int32), axis=0)
            take = (m & (key > kth)) | (eq & (tie_rank <= ties))
            pos = n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1
            slot = tl.load(crow_i + o, mask=take, other=0)
            ok = tl.load(vrow + slot, mask=take, other=0)
            tl.store(orow_i + pos, slot.to(tl.int64), mask=take)
            tl.store(orow_ok + pos, ok, mask=take)
            n_out += tl.sum(take.to(tl.int32), axis=0)
            n_tie += tl.sum(eq.to(tl.int32), axis=0)


def topk_select(scores: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best slots of each row of scores [T, L] (float32, invalid slots at -inf), k <= L, as idx [T, k]
    (int64, any order) and ok = valid.gather(1, idx) [T, k] (bool): dsa.Selection's fields."""
    if triton is None:
        raise RuntimeError("DSA top-k kernel needs Triton, which is not importable here")
    t, length = scores.shape
    if scores.dtype != torch.float32:
        raise ValueError(f"DSA top-k: scores dtype {scores.dtype}, expected torch.float32")
    if valid.shape != scores.shape or valid.dtype != torch.bool:
        raise ValueError(f"DSA top-k: valid {tuple(valid.shape)} {valid.dtype}, expected {tuple(scores.shape)} torch.bool")
    if not 0 < k <= length:
        raise ValueError(f"DSA top-k: k={k} outside 1..L={length}")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    if valid.stride(1) != 1:
        valid = valid.contiguous()
    idx = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    ok = torch.empty(t, k, dtype=torch.bool, device=scores.device)
    cand = torch.empty(2, t, length, dtype=torch.int32, device=scores.device)  # scratch: candidate keys, slots
    _topk_select_kernel[(t,)](scores, valid.view(torch.uint8), idx, ok.view(torch.uint8), cand[0], cand[1], length, k,
                              scores.stride(0), valid.stride(0), idx.stride(0), cand.stride(1),
                              BLOCK=TUNE["block"], num_warps=TUNE["num_warps"])
    return idx, ok
