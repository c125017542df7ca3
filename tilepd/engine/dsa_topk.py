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
  * long rows, or whenever the caller brings the top byte's histogram (dsa_indexer.index_scores adds it in its
    epilogue): a split launch over chunks of the row writes every slot above the k-th's top-byte bin (atomic
    counters place them), compacts the bin's slots (the candidates) into a scratch and adds their second byte's
    histogram; a refine launch over the candidates writes those above the k-th's two top bytes and compacts those
    equal to them (a 256th of the bin); then one program per row finishes as above over these (the two low bytes'
    histograms, the writes): its own launch, or (TUNE fused_finish) the refine's last program of the row. With the
    scores' histogram fused: 3 launches plus the memset, whatever L (2 with fused_finish, no memset with the kept
    scratch). Order and the choice among ties vary between runs there, the set's values do not.
The output always holds exactly k slots (k <= L); ties at the k-th value may be other slots of equal value than
torch.topk's. Static shapes, no host sync: CUDA-graph safe. The reference is torch.topk (dsa.select_topk).
"""

from __future__ import annotations

import torch

from tilepd.engine import pdl

from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
    from tilepd.engine.pdl import trigger, wait
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

# Rows up to one_program_max scores (and no histogram brought): one program per row (block scores per iteration,
# num_warps wide) reading the row twice. Otherwise the split runs over chunks of `chunk` scores (chunk_block per
# iteration) and the refine over its candidates the same way, then one program a row (block, num_warps) over the
# refined candidates. Why the refine: on the engine's scores one program walking the top byte's bin took 24-68 us a
# layer at 32K-200K (H200, 2026-12-03; ~2.3 us of latency a step), the refine spreads that walk over the GPU. Why not one program at long rows:
# Triton's tl.histogram costs ~100 instructions an element at 256 bins (warp ballots per bin), so one SM alone takes
# ~13 us a pass at 32K; the split spreads the row's second pass over the GPU and leaves the finish only its bin.
TUNE: dict[str, int] = {
    "one_program_max": env_int("TILEPD_DSA_TOPK_ONE_PROGRAM_MAX", 4096),
    "block": env_int("TILEPD_DSA_TOPK_BLOCK", 1024),
    "num_warps": env_int("TILEPD_DSA_TOPK_NUM_WARPS", 16),
    "chunk": env_int("TILEPD_DSA_TOPK_CHUNK", 1024),
    "chunk_block": env_int("TILEPD_DSA_TOPK_CHUNK_BLOCK", 1024),
    "chunk_warps": env_int("TILEPD_DSA_TOPK_CHUNK_WARPS", 8),
    # fused_finish: the refine launch's last program of a row (a ticket, as the MoE gate's) finishes that row, instead
    # of a fourth launch; scratch: dsa_indexer.index_topk keeps one zeroed histogram scratch per device and row count,
    # which the finishing program zeroes again after use, instead of a memset launch a layer. Both on: each takes one
    # launch and its gap out of the long-context layer (5 -> 3 with the scores'); GLM-5.1 fp8 78 layers at 32K on one
    # H200 (2026-12-06), 17.64 ms/token without, 17.56 with fused_finish, 17.48 with both, 14.3 -> 12.3 launches a layer.
    "fused_finish": env_int("TILEPD_DSA_TOPK_FUSED_FINISH", 1),
    "scratch": env_int("TILEPD_DSA_TOPK_SCRATCH", 1),
}


# A row's scratch (int32): the two top bytes' histograms, then the split's [slots written, candidates] and the refine's
# [slots written after the split's, candidates kept], each pair one 8-byte-aligned int64 word that one atomic claims (a
# program's two places in one round trip to L2, not two), then the refine's ticket and a pad that keeps rows 8-byte aligned.
SPLIT_AT, REFINE_AT, TICKET_AT = 2 * 256, 2 * 256 + 2, 2 * 256 + 4
HIST_COLS = 2 * 256 + 6


if triton is not None:
    _SPLIT_AT, _REFINE_AT, _TICKET_AT, _HIST_COLS = (tl.constexpr(v) for v in (SPLIT_AT, REFINE_AT, TICKET_AT, HIST_COLS))

    @triton.jit
    def _claim(pair, first, second):
        """One atomic add of (first, second) to the int32 pair at `pair` (an int64 word: first is its low half); the
        pair's values before it (undefined where both are 0: no atomic then, and nothing is placed). Neither count
        passes 2^31 (a row's slots), so no carry crosses the halves. Relaxed: only the places it hands out matter here,
        and what reads the writes runs after the kernel boundary (or, in the refine's finish, after the row ticket's
        acq_rel)."""
        old = tl.atomic_add(pair, first.to(tl.int64) + (second.to(tl.int64) << 32), mask=(first + second) > 0, sem="relaxed")
        return (old & 0xFFFFFFFF).to(tl.int32), (old >> 32).to(tl.int32)

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
    def _cand_hist(key, m, prefix, LEVEL: tl.constexpr, BLOCK: tl.constexpr):
        """Histogram of byte LEVEL over the candidates `key` (where m) whose higher bytes equal prefix."""
        return _masked_hist(_digit(key, LEVEL), m & ((key >> (32 - 8 * LEVEL)) == prefix), 256, BLOCK)

    @triton.jit
    def _cand_hist_rest(crow_k, n_cand, prefix, LEVEL: tl.constexpr, BLOCK: tl.constexpr):
        """_cand_hist over the scratch's candidates past its first block (usually none)."""
        offs = tl.arange(0, BLOCK)
        h = tl.zeros([256], tl.int32)
        for n0 in range(BLOCK, n_cand, BLOCK):
            o = n0 + offs
            m = o < n_cand
            h += _cand_hist(tl.load(crow_k + o, mask=m, other=0), m, prefix, LEVEL, BLOCK)
        return h

    @triton.jit
    def _take_ties(key, m, kth, ties, n_tie, n_out, slot, ok, orow_i, orow_ok):
        """Of one block of candidates: write those above the k-th key and the first ties equal to it (ties still
        needed, n_tie already taken) from output position n_out on; the new n_out and n_tie."""
        eq = m & (key == kth)
        tie_rank = n_tie + tl.cumsum(eq.to(tl.int32), axis=0)
        take = (m & (key > kth)) | (eq & (tie_rank <= ties))
        pos = n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(orow_i + pos, slot.to(tl.int64), mask=take)
        tl.store(orow_ok + pos, ok, mask=take)
        return n_out + tl.sum(take.to(tl.int32), axis=0), n_tie + tl.sum(eq.to(tl.int32), axis=0)

    @triton.jit
    def _finish_candidates(crow_k, crow_i, n_cand, prefix, k_rem, n_out, vrow, orow_i, orow_ok, BLOCK: tl.constexpr):
        """The select's end over the compacted candidates (keys whose two top bytes are `prefix`, k_rem of them still
        needed): the two low bytes' histograms, then the candidates above the k-th key and the first ties equal to it
        written from output position n_out on."""
        # the first block (usually every candidate) is loaded once, its slots' valid flags with it, and both
        # histograms and the writes read it from registers: one round trip to L2 where a pass each took one
        offs = tl.arange(0, BLOCK)
        m0 = offs < n_cand
        key0 = tl.load(crow_k + offs, mask=m0, other=0)
        slot0 = tl.load(crow_i + offs, mask=m0, other=0)
        ok0 = tl.load(vrow + slot0, mask=m0, other=0)
        j, above, _ = _find_bin(_cand_hist(key0, m0, prefix, 2, BLOCK) + _cand_hist_rest(crow_k, n_cand, prefix, 2, BLOCK), k_rem, 256)
        k_rem = k_rem - above
        prefix = prefix * 256 + j
        j, above, _ = _find_bin(_cand_hist(key0, m0, prefix, 3, BLOCK) + _cand_hist_rest(crow_k, n_cand, prefix, 3, BLOCK), k_rem, 256)
        ties = k_rem - above  # how many slots equal to the k-th key are still needed
        kth = prefix * 256 + j
        n_out, n_tie = _take_ties(key0, m0, kth, ties, tl.zeros([], tl.int32), n_out, slot0, ok0, orow_i, orow_ok)
        for n0 in range(BLOCK, n_cand, BLOCK):
            o = n0 + offs
            m = o < n_cand
            slot = tl.load(crow_i + o, mask=m, other=0)
            n_out, n_tie = _take_ties(tl.load(crow_k + o, mask=m, other=0), m, kth, ties, n_tie, n_out, slot,
                                      tl.load(vrow + slot, mask=m, other=0), orow_i, orow_ok)

    @triton.jit
    def _topk_one_program_kernel(S, VALID, IDX, OK, CAND_K, CAND_I, L, K, s_st, s_vt, s_it, s_ct, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        wait(PDL)  # everything it reads is the step's (pdl.py)
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
        _finish_candidates(crow_k, crow_i, n_cand, prefix, k_rem, n_out, vrow, orow_i, orow_ok, BLOCK)
        trigger(PDL)  # pdl.py: the late form triggers here

    @triton.jit
    def _topk_hist0_kernel(S, HIST, L, CHUNK, s_st, s_ht, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """The top byte's histogram of a chunk added to its row's (what index_scores' epilogue does when fused)."""
        wait(PDL)  # everything it reads is the step's (pdl.py)
        t = tl.program_id(1)
        start = tl.program_id(0) * CHUNK
        end = tl.minimum(start + CHUNK, L)
        offs = tl.arange(0, BLOCK)
        h = tl.zeros([256], tl.int32)
        for n0 in range(start, end, BLOCK):
            o = n0 + offs
            m = o < end
            h += _masked_hist(_digit(_ordered_key(tl.load(S + t * s_st + o, mask=m, other=0.0)), 0), m, 256, BLOCK)
        tl.atomic_add(HIST + t * s_ht + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")  # read after the kernel boundary
        trigger(PDL)  # pdl.py: the late form triggers here

    @triton.jit
    def _split_block(key, ok, o, m, prefix, counters, orow_i, orow_ok, crow_k, crow_i, BLOCK: tl.constexpr):
        """One block of the split (slots o where m, their keys and valid flags): write those above the k-th's top-byte
        bin, compact those in it; its candidates' second-byte histogram."""
        top = key >> 24
        gt = m & (top > prefix)
        cand = m & (top == prefix)
        base, cbase = _claim(counters, tl.sum(gt.to(tl.int32), axis=0), tl.sum(cand.to(tl.int32), axis=0))
        pos = base + tl.cumsum(gt.to(tl.int32), axis=0) - 1
        tl.store(orow_i + pos, o.to(tl.int64), mask=gt)
        tl.store(orow_ok + pos, ok, mask=gt)
        cpos = cbase + tl.cumsum(cand.to(tl.int32), axis=0) - 1
        tl.store(crow_k + cpos, key, mask=cand)
        tl.store(crow_i + cpos, o, mask=cand)
        return _masked_hist(_digit(key, 1), cand, 256, BLOCK)

    @triton.jit
    def _topk_split_kernel(S, VALID, HIST, IDX, OK, CAND_K, CAND_I, L, K, CHUNK, s_st, s_vt, s_ht, s_it, s_ct,
                           BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """From the top byte's histogram: write every slot above the k-th's bin (they are selected), compact the bin's
        slots (the candidates) into the scratch and add their second byte's histogram to the row's."""
        wait(PDL)  # everything it reads is the step's (pdl.py)
        t = tl.program_id(1)
        start = tl.program_id(0) * CHUNK
        end = tl.minimum(start + CHUNK, L)
        row = S + t * s_st
        vrow = VALID + t * s_vt
        hrow = HIST + t * s_ht
        bins = tl.arange(0, 256)
        counters = (hrow + _SPLIT_AT).to(tl.pointer_type(tl.int64))  # [slots above the bin written, candidates] as one word
        # the first block's scores and valid flags are loaded beside the histogram (none depends on another): one
        # round trip to L2 before the claim, where the histogram, then the scores, then the flags took one each
        o = start + tl.arange(0, BLOCK)
        m = o < end
        key = _ordered_key(tl.load(row + o, mask=m, other=0.0))
        ok = tl.load(vrow + o, mask=m, other=0)
        j, _, _ = _find_bin(tl.load(hrow + bins), K, 256)
        prefix = j - 128  # the candidates' key >> 24
        h = _split_block(key, ok, o, m, prefix, counters, IDX + t * s_it, OK + t * s_it, CAND_K + t * s_ct, CAND_I + t * s_ct, BLOCK)
        for n0 in range(start + BLOCK, end, BLOCK):
            o = n0 + tl.arange(0, BLOCK)
            m = o < end
            h += _split_block(_ordered_key(tl.load(row + o, mask=m, other=0.0)), tl.load(vrow + o, mask=m, other=0), o, m, prefix,
                              counters, IDX + t * s_it, OK + t * s_it, CAND_K + t * s_ct, CAND_I + t * s_ct, BLOCK)
        tl.atomic_add(hrow + 256 + bins, h, mask=h > 0, sem="relaxed")  # read after the kernel boundary (no fence behind the stores)
        trigger(PDL)  # pdl.py: the late form triggers here

    @triton.jit
    def _two_top_bytes(hrow, K):
        """From a row's two histograms: the k-th key >> 16, the slots above it (written first) and how many are still
        needed among the keys that share its two top bytes."""
        bins = tl.arange(0, 256)
        j, n_above, _ = _find_bin(tl.load(hrow + bins), K, 256)
        k_rem = K - n_above
        prefix = j - 128
        j, above, _ = _find_bin(tl.load(hrow + 256 + bins), k_rem, 256)
        return prefix * 256 + j, n_above + above, k_rem - above

    @triton.jit
    def _finish_row(VALID, HIST, IDX, OK, CAND2_K, CAND2_I, K, t, s_vt, s_ht, s_it, s_ct, BLOCK: tl.constexpr, CLEAN: tl.constexpr):
        """Row t's finish over the refined candidates (their count read past L1: other programs' atomics made it); CLEAN:
        then the row's scratch zeroed for its next use."""
        hrow = HIST + t * s_ht
        prefix, n_out, k_rem = _two_top_bytes(hrow, K)
        n_cand = tl.load(hrow + _REFINE_AT + 1, cache_modifier=".cg")
        _finish_candidates(CAND2_K + t * s_ct, CAND2_I + t * s_ct, n_cand, prefix, k_rem, n_out, VALID + t * s_vt, IDX + t * s_it,
                           OK + t * s_it, BLOCK)
        if CLEAN:
            tl.debug_barrier()  # every thread's reads of the row are done
            cols = tl.arange(0, 1024)
            tl.store(hrow + cols, tl.zeros([1024], tl.int32), mask=cols < _HIST_COLS)

    @triton.jit
    def _refine_block(key, slot, ok, m, prefix, written, counters, orow_i, orow_ok, crow2_k, crow2_i):
        """One block of the refine (candidates where m, their slots and valid flags): write those above the k-th key's
        two top bytes after the split's `written` slots, compact those equal to them."""
        hi = key >> 16
        take = m & (hi > prefix)
        keep = m & (hi == prefix)
        base, cbase = _claim(counters, tl.sum(take.to(tl.int32), axis=0), tl.sum(keep.to(tl.int32), axis=0))
        pos = written + base + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(orow_i + pos, slot.to(tl.int64), mask=take)
        tl.store(orow_ok + pos, ok, mask=take)
        cpos = cbase + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(crow2_k + cpos, key, mask=keep)
        tl.store(crow2_i + cpos, slot, mask=keep)

    @triton.jit
    def _topk_refine_kernel(VALID, HIST, IDX, OK, CAND_K, CAND_I, CAND2_K, CAND2_I, K, CHUNK, CAP, s_vt, s_ht, s_it, s_ct,
                            BLOCK: tl.constexpr, FINISH: tl.constexpr = False, CLEAN: tl.constexpr = False, PDL: tl.constexpr = False):
        """Over the split's candidates in parallel (programs past their count do nothing): write those above the k-th
        key's two top bytes, compact those equal to them (usually a few hundred) for the finish. FINISH: each program
        then takes a ticket of its row (a CTA barrier, one acq_rel atomic: the MoE gate's pattern) and the row's last
        program finishes it (_finish_row), putting the ticket back to 0. CAP: the scratch rows' length."""
        wait(PDL)  # everything it reads is the step's (pdl.py)
        t = tl.program_id(1)
        hrow = HIST + t * s_ht
        vrow = VALID + t * s_vt
        crow_k = CAND_K + t * s_ct
        crow_i = CAND_I + t * s_ct
        start = tl.program_id(0) * CHUNK
        # the first block's candidates are loaded beside the counts and the histograms, as far as the scratch row
        # reaches (the count masks them after; past it the scratch holds anything, never read as an address): one
        # round trip to L2 where the counts, then the candidates took one each
        o = start + tl.arange(0, BLOCK)
        key = tl.load(crow_k + o, mask=o < CAP, other=0)
        slot = tl.load(crow_i + o, mask=o < CAP, other=0)
        end = tl.minimum(start + CHUNK, tl.load(hrow + _SPLIT_AT + 1))
        written = tl.load(hrow + _SPLIT_AT)  # the split's slots: the refine's go after them
        counters = (hrow + _REFINE_AT).to(tl.pointer_type(tl.int64))  # [slots written, candidates kept] as one word
        prefix, _, _ = _two_top_bytes(hrow, K)
        m = o < end
        ok = tl.load(vrow + slot, mask=m, other=0)  # each candidate's valid flag, gathered while the bins are found
        _refine_block(key, slot, ok, m, prefix, written, counters, IDX + t * s_it, OK + t * s_it, CAND2_K + t * s_ct, CAND2_I + t * s_ct)
        for n0 in range(start + BLOCK, end, BLOCK):
            o = n0 + tl.arange(0, BLOCK)
            m = o < end
            slot = tl.load(crow_i + o, mask=m, other=0)
            _refine_block(tl.load(crow_k + o, mask=m, other=0), slot, tl.load(vrow + slot, mask=m, other=0), m, prefix, written, counters,
                          IDX + t * s_it, OK + t * s_it, CAND2_K + t * s_ct, CAND2_I + t * s_ct)
        if FINISH:
            tl.debug_barrier()  # every thread's candidates and counts before the ticket's release
            ticket = tl.atomic_add(hrow + _TICKET_AT, 1, sem="acq_rel")
            if ticket == tl.num_programs(0) - 1:  # the row's last program: every candidate is out
                _finish_row(VALID, HIST, IDX, OK, CAND2_K, CAND2_I, K, t, s_vt, s_ht, s_it, s_ct, BLOCK, CLEAN)
                if not CLEAN:
                    tl.atomic_xchg(hrow + _TICKET_AT, 0)
        trigger(PDL)  # pdl.py: the late form triggers here

    @triton.jit
    def _topk_finish_kernel(VALID, HIST, IDX, OK, CAND2_K, CAND2_I, K, s_vt, s_ht, s_it, s_ct, BLOCK: tl.constexpr,
                            CLEAN: tl.constexpr = False, PDL: tl.constexpr = False):
        """One program per row over the refined candidates (the k-th key's two top bytes): _finish_row."""
        wait(PDL)  # everything it reads is the step's (pdl.py)
        _finish_row(VALID, HIST, IDX, OK, CAND2_K, CAND2_I, K, tl.program_id(0), s_vt, s_ht, s_it, s_ct, BLOCK, CLEAN)
        trigger(PDL)  # pdl.py: the late form triggers here


_SCRATCH: dict[tuple[torch.device, int], torch.Tensor] = {}  # TUNE["scratch"]: one per device and row count, zero between uses


def new_hist(rows: int, device: torch.device) -> torch.Tensor:
    """The zeroed [rows, HIST_COLS] int32 scratch that dsa_indexer.index_scores can fill with the first byte's histogram."""
    return torch.zeros(rows, HIST_COLS, dtype=torch.int32, device=device)


def scratch(rows: int, device: torch.device) -> torch.Tensor:
    """The device's kept scratch for `rows` rows (TUNE["scratch"]): zero between uses because topk_select(clean=True)
    zeroes it again. Made at the first (uncaptured) call; one first made inside a CUDA-graph capture would be zeroed
    only by the graph's replays, so that is refused by name (as the MoE gate's ticket counter)."""
    key = (device, rows)
    h = _SCRATCH.get(key)
    if h is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("DSA top-k: its kept scratch is made by an uncaptured call; run the step once before capturing it")
        h = _SCRATCH[key] = new_hist(rows, device)
    return h


def topk_select(scores: torch.Tensor, valid: torch.Tensor, k: int, hist: torch.Tensor | None = None,
                clean: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best slots of each row of scores [T, L] (float32, invalid slots at -inf), k <= L, as idx [T, k]
    (int64, any order) and ok = valid.gather(1, idx) [T, k] (bool): dsa.Selection's fields.

    hist: new_hist(T)'s scratch with the scores' top-byte histogram already added (index_scores(..., hist=...)):
    then the select is three launches whatever L (split, refine, finish; two with TUNE["fused_finish"]). Without it
    rows up to one_program_max take one launch, longer ones four (the first byte's histogram with its memset before the
    three). clean: the finishing program zeroes hist's rows after use (a scratch kept between calls, scratch())."""
    if triton is None:
        raise RuntimeError("DSA top-k kernel needs Triton, which is not importable here")
    t, length = scores.shape
    if scores.dtype != torch.float32:
        raise ValueError(f"DSA top-k: scores dtype {scores.dtype}, expected torch.float32")
    if valid.shape != scores.shape or valid.dtype != torch.bool:
        raise ValueError(f"DSA top-k: valid {tuple(valid.shape)} {valid.dtype}, expected {tuple(scores.shape)} torch.bool")
    if not 0 < k <= length:
        raise ValueError(f"DSA top-k: k={k} outside 1..L={length}")
    if hist is not None and (hist.shape != (t, HIST_COLS) or hist.dtype != torch.int32 or hist.stride(1) != 1):
        raise ValueError(f"DSA top-k: hist {tuple(hist.shape)} {hist.dtype}, expected contiguous ({t}, {HIST_COLS}) torch.int32")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    if valid.stride(1) != 1:
        valid = valid.contiguous()
    idx = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    ok = torch.empty(t, k, dtype=torch.bool, device=scores.device)
    valid_u8, ok_u8 = valid.view(torch.uint8), ok.view(torch.uint8)
    if hist is None and length <= TUNE["one_program_max"]:
        cand = torch.empty(2, t, length, dtype=torch.int32, device=scores.device)  # scratch: candidate keys, slots
        _topk_one_program_kernel[(t,)](scores, valid_u8, idx, ok_u8, cand[0], cand[1], length, k,
                                       scores.stride(0), valid.stride(0), idx.stride(0), cand.stride(1),
                                       BLOCK=TUNE["block"], num_warps=TUNE["num_warps"], **pdl.launch_args(scores, "dsa"))
        return idx, ok
    chunk = TUNE["chunk"]
    grid = (triton.cdiv(length, chunk), t)
    if hist is None:
        hist = new_hist(t, scores.device)
        _topk_hist0_kernel[grid](scores, hist, length, chunk, scores.stride(0), hist.stride(0),
                                 BLOCK=TUNE["chunk_block"], num_warps=TUNE["chunk_warps"], **pdl.launch_args(scores, "dsa"))
    cand = torch.empty(4, t, length, dtype=torch.int32, device=scores.device)  # the split's candidates, the finish's
    _topk_split_kernel[grid](scores, valid_u8, hist, idx, ok_u8, cand[0], cand[1], length, k, chunk, scores.stride(0),
                             valid.stride(0), hist.stride(0), idx.stride(0), cand.stride(1),
                             BLOCK=TUNE["chunk_block"], num_warps=TUNE["chunk_warps"], **pdl.launch_args(scores, "dsa"))
    fused = bool(TUNE["fused_finish"])
    _topk_refine_kernel[grid](valid_u8, hist, idx, ok_u8, cand[0], cand[1], cand[2], cand[3], k, chunk, length, valid.stride(0), hist.stride(0),
                              idx.stride(0), cand.stride(1), BLOCK=TUNE["chunk_block"], FINISH=fused, CLEAN=fused and clean,
                              num_warps=TUNE["chunk_warps"], **pdl.launch_args(valid_u8, "dsa"))
    if not fused:
        _topk_finish_kernel[(t,)](valid_u8, hist, idx, ok_u8, cand[2], cand[3], k, valid.stride(0), hist.stride(0), idx.stride(0),
                                  cand.stride(1), BLOCK=TUNE["block"], CLEAN=clean, num_warps=TUNE["num_warps"], **pdl.launch_args(valid_u8, "dsa"))
    return idx, ok
