"""Block-scaled fp8 runtime tensors: which ones, their block and scale shapes, and their rank-local bytes.

A runtime tensor is stored fp8 when the layout marks it a GEMV weight the engine reads through
`layers.linear` (`quantizable`) and either the source checkpoint stores all its parts in fp8 with a
`weight_scale_inv` (kept exactly: values and scales copied) or a bf16/fp32 source is converted with
`--dtype fp8` (each source part quantised to e4m3 with 128x128 block scales, amax/448, as DeepSeek's fp8
checkpoints were made; so bf16 -> fp8 gives what the fp8 checkpoint of that model would hold). MLA's
kv_b_proj is the exception: it is split per head into W_UK / W_UV and absorbed, and vLLM dequantises it
at load for exactly that (vLLM 0.32 vllm/model_executor/layers/attention/mla_attention.py:1248,
`MLAAttention.process_weights_after_loading` -> `split_kv_b_proj` (:407) -> `get_and_maybe_dequant_weights`),
so tilepd stores those two in the compute dtype. An fp8 checkpoint's dense tensors (norms, embeddings,
lm_head, router, MTP eh_proj) stay dense, as they are in the checkpoint.

Parts are fused along rows (q/k/v, gate/up) and sharded for tensor parallelism. When every part's
rank-local row range starts on a block boundary the source scales concatenate as they are; otherwise the
scales are repeated per row (block (1, block_k)): the same values and scales, 1/32 more bytes for scales.
A column shard must start on a block boundary (vLLM refuses the same for block-fp8 TP); else a clear error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from tilepd.model_format.block_fp8 import DEFAULT_BLOCK, FP8, BlockFp8, quantize
from tilepd.weights.errors import WeightsError
from tilepd.weights.out_tensors import OutTensor

ShapeOf = Callable[[str], tuple[int, ...]]


def stores_fp8(t: OutTensor, is_fp8: Callable[[str], bool], fp8_requested: bool, fp8_checkpoint: bool) -> bool:
    """Whether runtime tensor t is stored block-scaled fp8. Only when fp8 is asked for (--dtype fp8, or an
    fp8 HF checkpoint loaded as it is) and only GEMV weights the engine reads through layers.linear; from an
    fp8 checkpoint exactly those whose parts are fp8 (kept), from a dense one every such weight (quantised)."""
    if not t.quantizable or t.mla or t.keep_fp32 or not fp8_requested:
        return False
    flags = {is_fp8(p) for p in t.sources}
    if len(flags) > 1:
        fp8_parts = [p for p in t.sources if is_fp8(p)][:3]
        raise WeightsError(f"{t.name}: its source parts mix fp8 ({', '.join(fp8_parts)}) and non-fp8 tensors; cannot fuse them")
    return flags == {True} if fp8_checkpoint else True


def _row_block(t: OutTensor, shape_of: ShapeOf, tp: int, bn: int) -> int:
    """bn when every part's rank-local rows start on a block boundary after fusing, else 1."""
    for g in t.groups:
        start = 0
        for p in g:
            rows = shape_of(p)[0]
            local = rows // tp if t.shard_dim == 0 and tp > 1 else rows
            if t.shard_dim == 0 and tp > 1 and local % bn:  # rank r's shard starts at r*local
                return 1
            if start % bn:
                return 1
            start += local
    return bn


def block_and_scale_shape(t: OutTensor, shape_of: ShapeOf, tp: int, source_block: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, ...]]:
    """(block of the runtime tensor, shape of its scale tensor) for one rank, from source shapes only."""
    bn, bk = source_block
    cols = shape_of(t.sources[0])[1]
    if t.shard_dim == 1 and tp > 1:
        if cols % tp or (cols // tp) % bk:
            raise WeightsError(f"{t.name}: {cols} input columns split {tp} ways do not start on fp8 block boundaries "
                               f"(block {bk}); use a tensor-parallel size whose column shards are multiples of {bk}, or a dense --dtype")
        cols //= tp
    block = (_row_block(t, shape_of, tp, bn), bk)
    rows = 0
    for p in t.groups[0]:
        rows += shape_of(p)[0] // tp if t.shard_dim == 0 and tp > 1 else shape_of(p)[0]
    scale = (-(-rows // block[0]), -(-cols // bk))
    return block, ((len(t.groups),) + scale if t.stacked else scale)


def _shard(w: BlockFp8, dim: int | None, rank: int, tp: int) -> BlockFp8:
    if dim is None or tp == 1:
        return w
    size = w.weight.shape[dim] // tp
    lo, hi = rank * size, (rank + 1) * size
    b = w.block[dim]
    if lo % b:
        raise WeightsError(f"fp8 shard at {lo} along dim {dim} does not start on a block boundary ({b})")  # block_and_scale_shape() prevents this
    weight = w.weight.narrow(dim, lo, size)
    scale = w.scale.narrow(dim, lo // b, -(-hi // b) - lo // b)
    return BlockFp8(weight.contiguous(), scale.contiguous(), w.block)


def _per_row(w: BlockFp8) -> BlockFp8:
    if w.block[0] == 1:
        return w
    rows = w.weight.shape[0]
    return BlockFp8(w.weight, w.scale.repeat_interleave(w.block[0], dim=0)[:rows].contiguous(), (1, w.block[1]))


def build(t: OutTensor, get_fp8: Callable[[str], BlockFp8], block: tuple[int, int], rank: int, tp: int) -> Iterator[BlockFp8]:
    """Yield the rank-local BlockFp8 of each group (one per expert when stacked) with the planned block."""
    for g in t.groups:
        parts = []
        for p in g:
            w = get_fp8(p)
            if w.block[1] != block[1]:
                raise WeightsError(f"{p}: block {list(w.block)} differs from the planned {list(block)}")
            if block[0] == 1:
                w = _per_row(w)
            parts.append(_shard(w, t.shard_dim, rank, tp))
        if len(parts) == 1:
            yield parts[0]
        else:
            yield BlockFp8(torch.cat([q.weight for q in parts]), torch.cat([q.scale for q in parts]), block)


def source_reader(get_raw: Callable[[str], tuple[torch.Tensor, torch.Tensor | None]], block: tuple[int, int]) -> Callable[[str], BlockFp8]:
    """name -> BlockFp8: an fp8 source part as stored (its weight_scale_inv), a dense one quantised."""

    def get_fp8(name: str) -> BlockFp8:
        w, scale_inv = get_raw(name)
        if scale_inv is None:
            if w.dtype == FP8:
                raise WeightsError(f"{name}: fp8 tensor without {name}_scale_inv (per-tensor fp8 is not supported)")
            return quantize(w, DEFAULT_BLOCK)
        try:
            return BlockFp8(w, scale_inv.float(), block)
        except ValueError as e:
            raise WeightsError(f"{name}: {e}") from e

    return get_fp8
