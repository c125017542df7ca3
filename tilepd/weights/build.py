"""Turn one OutTensor plan entry into bytes for one tensor-parallel rank, chunk by chunk."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from tilepd.model_format.model_spec import ModelSpec
from tilepd.weights.out_tensors import OutTensor, source_float_dtype
from tilepd.weights.source import WeightsError


def _shard_shape(shape: tuple[int, ...], dim: int | None, tp: int, name: str) -> tuple[int, ...]:
    if dim is None or tp == 1:
        return shape
    if shape[dim] % tp:
        raise WeightsError(f"cannot shard {name} of shape {list(shape)} along dim {dim} into {tp} ranks")
    return shape[:dim] + (shape[dim] // tp,) + shape[dim + 1 :]


def _mla_dims(spec: ModelSpec, which: str) -> tuple[int, int]:
    nope, v = spec.qk_nope_head_dim, spec.v_head_dim
    return (0, nope) if which == "uk" else (nope, nope + v)


def out_shape(t: OutTensor, shape_of: Callable[[str], tuple[int, ...]], spec: ModelSpec, tp: int) -> tuple[int, ...]:
    """Shape of the rank-local output tensor, from source shapes only (nothing read)."""
    if t.mla:
        rows, rank = shape_of(t.sources[0])
        heads = spec.num_heads
        if rows != heads * (spec.qk_nope_head_dim + spec.v_head_dim):
            raise WeightsError(f"{t.sources[0]}: shape {[rows, rank]} does not match {heads} heads x (nope+v)")
        lo, hi = _mla_dims(spec, t.mla)
        return _shard_shape((heads, hi - lo, rank), 0, tp, t.name)
    group_shapes = []
    for g in t.groups:
        parts = []
        for p in g:
            shape = shape_of(p)
            dim = t.shard_dim if t.shard_dim is not None and len(shape) > t.shard_dim else None
            parts.append(_shard_shape(shape, dim, tp, p))
        rest = {s[1:] for s in parts}
        if len(rest) != 1:
            raise WeightsError(f"{t.name}: parts {list(g)} have mismatched shapes {parts}")
        group_shapes.append((sum(s[0] for s in parts),) + parts[0][1:])
    if t.stacked:
        if len(set(group_shapes)) != 1:
            raise WeightsError(f"{t.name}: stacked groups differ in shape")
        return (len(group_shapes),) + group_shapes[0]
    return group_shapes[0]


def _part(get: Callable[[str], torch.Tensor], name: str, dim: int | None, rank: int, tp: int) -> torch.Tensor:
    x = get(name)
    if dim is None or tp == 1 or x.dim() <= dim:
        return x
    return x.chunk(tp, dim=dim)[rank]


def build_chunks(t: OutTensor, get: Callable[[str], torch.Tensor], spec: ModelSpec, rank: int, tp: int) -> Iterator[torch.Tensor]:
    """Yield consecutive row-major pieces of the rank-local tensor (one per expert when stacked)."""
    if t.mla:
        kvb = get(t.sources[0])
        per_head = kvb.view(spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, -1)
        lo, hi = _mla_dims(spec, t.mla)
        piece = per_head[:, lo:hi, :]
        yield piece.chunk(tp, dim=0)[rank] if tp > 1 else piece
        return
    for g in t.groups:
        parts = [_part(get, p, t.shard_dim, rank, tp) for p in g]
        yield parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def stored_dtype(t: OutTensor, source: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype runtime tensor t is stored in, from its source's dtype and the conversion's dense dtype: float32 for
    keep_fp32 tensors, the source's own bf16 or else float32 for source_float ones (the router gate), else `dtype`."""
    if t.keep_fp32:
        return torch.float32
    if t.source_float:
        return getattr(torch, source_float_dtype(str(source).removeprefix("torch."), dtype == torch.float32))
    return dtype


def cast_chunk(t: OutTensor, chunk: torch.Tensor, dtype: torch.dtype, fp8: bool = False) -> tuple[torch.Tensor, None]:
    """Cast a dense chunk to its stored dtype (stored_dtype; a source_float chunk is its one source tensor, so its dtype
    is the source's). Block-scaled fp8 tensors are built by fp8_build, never here (the tuple's second slot is kept for
    callers that unpack two values)."""
    if fp8:
        raise ValueError(f"{t.name}: fp8 tensors are built by tilepd.weights.fp8_build, not cast_chunk")
    return chunk.to(stored_dtype(t, chunk.dtype, dtype)).contiguous(), None
