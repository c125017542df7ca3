"""DSA's top-k over the indexer scores as a radix select in Triton: no sort, no torch.topk.

Why: torch.topk(k=2048) over a [T, L] row costs a radix sort (L <= k) or several gatherTopK passes per layer
(the issue 24 profile: ~50 us a layer of topk kernels at 1K). The MLA kernel does not care about the order of
the selected slots, so only the SET of the k best is needed, which a radix select finds in O(L).

Scores are mapped to int32 keys that order like the floats; the k-th best key is found one byte at a time
(vLLM's top_k_per_row does the same with 11-bit digits in CUDA): the histogram of the top byte says which bin
holds the k-th best and how many lie above it; the next byte is histogrammed over that bin only, and so on
for 4 bytes. Then every slot above the k-th key is written, and as many slots equal to it as are still needed.
  * short rows (one_program_max): one program per row, one launch. Its second pass writes the slots above the
    top byte's bin at once and compacts the bin (the candidates) into a scratch, so the two low bytes and the
    last write read only the candidates: the row itself is read twice. Ties are taken in slot order.
  * long rows: the row in chunks over many programs, one launch per byte (each chunk adds its histogram to the
    row's with atomics) and one for the writes (atomic counters place them; order and the choice among ties
    vary between runs, the set's values do not).
The output always holds exactly k slots (k <= L); ties at the k-th value may be other slots of equal value than
torch.topk's. Static shapes, no host sync: CUDA-graph safe. The reference is torch.topk (dsa.select_topk).
"""

from __future__ import annotations

import torch

from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

# Rows up to one_program_max scores: one program per row (block scores per iteration, num_warps wide) reading
# the row twice. Longer rows: the row split in chunks of `chunk` scores over many programs, one launch per key
# byte adding each chunk's histogram to the row's (atomics), then one launch writing the selection (6 launches
# with the histograms' memset, each reading the row once from L2). Why the split: Triton's tl.histogram costs
# ~100 instructions an element at 256 bins (warp ballots per bin), so one SM alone takes ~13 us a pass at 32K.
TUNE: dict[str, int] = {
    "one_program_max": env_int("TILEPD_DSA_TOPK_ONE_PROGRAM_MAX", 4096),
    "block": env_int("TILEPD_DSA_TOPK_BLOCK", 1024),
    "num_warps": env_int("TILEPD_DSA_TOPK_NUM_WARPS", 16),
    "chunk": env_int("TILEPD_DSA_TOPK_CHUNK", 2048),
    "chunk_block": env_int("TILEPD_DSA_TOPK_CHUNK_BLOCK", 1024),
    "chunk_warps": env_int("TILEPD_DSA_TOPK_CHUNK_WARPS", 8),
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
    def _digit(key, LEVEL: tl.constexpr):
        """Byte LEVEL (0 = the top, sign-corrected so bins order like the keys) of the key."""
        if LEVEL == 0:
            return ((key >> 24) + 128) & 255
        else:
            return (key >> (24 - 8 * LEVEL)) & 255

    @triton.jit
    def _cand_hist(crow_k, n_cand, prefix, LEVEL: tl.constexpr, BLOCK: tl.constexpr):
        """Histogram of byte LEVEL over the scratch's candidates whose higher bytes equal prefix."""
        offs = tl.arange(0, BLOCK)
        h = tl.zeros([256], tl.int32)
        for n0 in range(0, n_cand, BLOCK):
            o = n0 + offs
            m = o < n_cand
            key = tl.load(crow_k + o, mask=m, other=0)
            h += _masked_hist(_digit(key, LEVEL), m & ((key >> (32 - 8 * LEVEL)) == prefix), 256, BLOCK)
        return h

    @triton.jit
    def _topk_one_program_kernel(S, VALID, IDX, OK, CAND_K, CAND_I, L, K, s_st, s_vt, s_it, s_ct, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        row = S + t * s_st
        vrow = VALID + t * s_vt
        orow_i = IDX + t * s_it
        orow_ok = OK + t * s_it
        crow_k = CAND_K + t * s_ct
        crow_i = CAND_I + t * s_ct
        offs = tl.arange(0, BLOCK)
        # 1. the top byte over the row
        h = tl.zeros([256], tl.int32)
        for n0 in range(0, L, BLOCK):
            o = n0 + offs
            m = o < L
            h += _masked_hist(_digit(_ordered_key(tl.load(row + o, mask=m, other=0.0)), 0), m, 256, BLOCK)
        j, above, n_cand = _find_bin(h, K, 256)
        k_rem = K - above
        prefix = j - 128  # the candidates' key >> 24
        # 2. write the slots above that bin, compact the bin into the scratch, histogram its next byte
        h = tl.zeros([256], tl.int32)
        n_out = tl.zeros([], tl.int32)
        n_in = tl.zeros([], tl.int32)
        for n0 in range(0, L, BLOCK):
            o = n0 + offs
            m = o < L
            key = _ordered_key(tl.load(row + o, mask=m, other=0.0))
            top = key >> 24
            take = m & (top > prefix)
            pos = n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(orow_i + pos, o.to(tl.int64), mask=take)
            tl.store(orow_ok + pos, tl.load(vrow + o, mask=take, other=0), mask=take)
            n_out += tl.sum(take.to(tl.int32), axis=0)
            cand = m & (top == prefix)
            cpos = n_in + tl.cumsum(cand.to(tl.int32), axis=0) - 1
            tl.store(crow_k + cpos, key, mask=cand)
            tl.store(crow_i + cpos, o, mask=cand)
            n_in += tl.sum(cand.to(tl.int32), axis=0)
            h += _masked_hist(_digit(key, 1), cand, 256, BLOCK)
        tl.debug_barrier()  # the candidates written above are read back by other threads below
        j, above, _ = _find_bin(h, k_rem, 256)
        k_rem = k_rem - above
        prefix = prefix * 256 + j
        # 3. the two low bytes over the candidates only
        j, above, _ = _find_bin(_cand_hist(crow_k, n_cand, prefix, 2, BLOCK), k_rem, 256)
        k_rem = k_rem - above
        prefix = prefix * 256 + j
        j, above, _ = _find_bin(_cand_hist(crow_k, n_cand, prefix, 3, BLOCK), k_rem, 256)
        ties = k_rem - above  # how many slots equal to the k-th key are still needed
        kth = prefix * 256 + j
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
            tl.store(orow_i + pos, slot.to(tl.int64), mask=take)
            tl.store(orow_ok + pos, tl.load(vrow + slot, mask=take, other=0), mask=take)
            n_out += tl.sum(take.to(tl.int32), axis=0)
            n_tie += tl.sum(eq.to(tl.int32), axis=0)

    @triton.jit
    def _walk_levels(HIST, K, LEVELS: tl.constexpr):
        """From the global histograms of bytes 0..LEVELS-1: the k-th key's top LEVELS bytes and how many are still needed."""
        k_rem = K
        prefix = 0
        for lvl in tl.static_range(LEVELS):
            j, above, _ = _find_bin(tl.load(HIST + lvl * 256 + tl.arange(0, 256)), k_rem, 256)
            k_rem = k_rem - above
            if lvl == 0:
                prefix = j - 128
            else:
                prefix = prefix * 256 + j
        return prefix, k_rem

    @triton.jit
    def _topk_hist_kernel(S, HIST, L, K, CHUNK, s_st, s_ht, LEVEL: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(1)
        start = tl.program_id(0) * CHUNK
        row = S + t * s_st
        hrow = HIST + t * s_ht
        prefix, _ = _walk_levels(hrow, K, LEVEL)
        offs = tl.arange(0, BLOCK)
        h = tl.zeros([256], tl.int32)
        for n0 in range(start, tl.minimum(start + CHUNK, L), BLOCK):
            o = n0 + offs
            m = o < tl.minimum(start + CHUNK, L)
            key = _ordered_key(tl.load(row + o, mask=m, other=0.0))
            if LEVEL > 0:
                m = m & ((key >> (32 - 8 * LEVEL)) == prefix)
            h += _masked_hist(_digit(key, LEVEL), m, 256, BLOCK)
        bins = tl.arange(0, 256)
        tl.atomic_add(hrow + LEVEL * 256 + bins, h, mask=h > 0)

    @triton.jit
    def _topk_collect_kernel(S, VALID, HIST, IDX, OK, L, K, CHUNK, s_st, s_vt, s_ht, s_it, BLOCK: tl.constexpr):
        t = tl.program_id(1)
        start = tl.program_id(0) * CHUNK
        row = S + t * s_st
        hrow = HIST + t * s_ht
        kth, ties = _walk_levels(hrow, K, 4)
        counters = hrow + 4 * 256  # [slots above the k-th written, ties at it seen]
        offs = tl.arange(0, BLOCK)
        for n0 in range(start, tl.minimum(start + CHUNK, L), BLOCK):
            o = n0 + offs
            m = o < tl.minimum(start + CHUNK, L)
            key = _ordered_key(tl.load(row + o, mask=m, other=0.0))
            ok = tl.load(VALID + t * s_vt + o, mask=m, other=0)
            gt = m & (key > kth)
            base = tl.atomic_add(counters, tl.sum(gt.to(tl.int32), axis=0))
            pos = base + tl.cumsum(gt.to(tl.int32), axis=0) - 1
            tl.store(IDX + t * s_it + pos, o.to(tl.int64), mask=gt)
            tl.store(OK + t * s_it + pos, ok, mask=gt)
            eq = m & (key == kth)
            tie_base = tl.atomic_add(counters + 1, tl.sum(eq.to(tl.int32), axis=0))
            rank = tie_base + tl.cumsum(eq.to(tl.int32), axis=0) - 1
            take = eq & (rank < ties)
            pos = K - ties + rank  # ties fill the last `ties` outputs
            tl.store(IDX + t * s_it + pos, o.to(tl.int64), mask=take)
            tl.store(OK + t * s_it + pos, ok, mask=take)


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
    valid_u8, ok_u8 = valid.view(torch.uint8), ok.view(torch.uint8)
    if length <= TUNE["one_program_max"]:
        cand = torch.empty(2, t, length, dtype=torch.int32, device=scores.device)  # scratch: candidate keys, slots
        _topk_one_program_kernel[(t,)](scores, valid_u8, idx, ok_u8, cand[0], cand[1], length, k,
                                       scores.stride(0), valid.stride(0), idx.stride(0), cand.stride(1),
                                       BLOCK=TUNE["block"], num_warps=TUNE["num_warps"])
        return idx, ok
    chunk = TUNE["chunk"]
    grid = (triton.cdiv(length, chunk), t)
    hist = torch.zeros(t, 4 * 256 + 2, dtype=torch.int32, device=scores.device)  # 4 byte histograms + 2 counters a row
    for level in range(4):
        _topk_hist_kernel[grid](scores, hist, length, k, chunk, scores.stride(0), hist.stride(0), LEVEL=level,
                                BLOCK=TUNE["chunk_block"], num_warps=TUNE["chunk_warps"])
    _topk_collect_kernel[grid](scores, valid_u8, hist, idx, ok_u8, length, k, chunk, scores.stride(0), valid.stride(0), hist.stride(0),
                               idx.stride(0), BLOCK=TUNE["chunk_block"], num_warps=TUNE["chunk_warps"])
    return idx, ok
