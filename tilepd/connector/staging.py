"""Staging buffer: where a claimed request's blocks are copied inside the forward window.

Why a staging copy instead of sending straight from vLLM's paged cache: once the
copy is done the request's blocks may be freed at once (no delayed free, no
scheduler back-pressure), and the network part runs in a background thread off
the prefill step. One slot holds one request, laid out like the decode node's
receive buffer (layer l at ``l * region_stride``, block i at ``i * block_bytes``),
so one transfer is ``num_layers`` contiguous segments (plus one per indexer layer of a
DSA model: indexer layer j at ``indexer_base + j * indexer_region_stride``).

The whole pool is one contiguous tensor, registered once with the transport.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from tilepd.control.cache_layout import CacheLayout

# index_select on fp8 / bf16 is not implemented everywhere; gather raw bits instead
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class StagingSlot:
    index: int
    offset: int  # byte offset of layer 0's region inside the pool buffer


class StagingPool:
    """A fixed number of request-sized slots in one registered buffer."""

    def __init__(self, layout: CacheLayout, max_seq_len: int, num_slots: int, *, pin_memory: bool = False):
        if num_slots < 1:
            raise ValueError("staging pool needs at least one slot")
        self.layout = layout
        self.max_seq_len = max_seq_len
        self.region_stride = layout.region_stride(max_seq_len)
        self.slot_bytes = layout.buffer_bytes(max_seq_len)
        ix = layout.indexer
        self.indexer_base = layout.indexer_base(max_seq_len)
        self.indexer_region_stride = ix.region_stride(max_seq_len) if ix is not None else 0
        self.num_slots = num_slots
        self.buffer = torch.empty(self.slot_bytes * num_slots, dtype=torch.uint8, pin_memory=pin_memory)
        self._free = list(range(num_slots))
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)

    def acquire(self, timeout: float = 0.0) -> StagingSlot | None:
        """A free slot, waiting up to `timeout` s; None if none came free.

        There is no wait without a bound: the caller runs inside vLLM's forward step, and slots held by
        transfers to a stalled decode node would hold the whole prefill with it."""
        if timeout is None or timeout < 0:
            raise ValueError(f"staging acquire needs a bounded timeout >= 0 s, got {timeout!r}")
        with self._freed:
            if not self._free and timeout > 0.0:
                self._freed.wait_for(lambda: bool(self._free), timeout)
            if not self._free:
                return None
            i = self._free.pop()
            return StagingSlot(i, i * self.slot_bytes)

    def release(self, slot: StagingSlot) -> None:
        with self._freed:
            if slot.index in self._free:
                raise RuntimeError(f"staging slot {slot.index} released twice")
            self._free.append(slot.index)
            self._freed.notify()

    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def layer_bytes(self, slot: StagingSlot, layer: int, num_blocks: int, start_block: int = 0) -> torch.Tensor:
        """The uint8 bytes of blocks [start_block, start_block + num_blocks) of `layer` in `slot`."""
        start = slot.offset + layer * self.region_stride + start_block * self.layout.block_bytes
        return self.buffer[start : start + num_blocks * self.layout.block_bytes]

    def indexer_bytes(self, slot: StagingSlot, j: int, num_blocks: int, start_block: int = 0) -> torch.Tensor:
        """The bytes of indexer blocks [start_block, start_block + num_blocks) of indexer layer j in `slot`."""
        ix = self.layout.indexer
        assert ix is not None, "layout has no indexer segment"
        start = slot.offset + self.indexer_base + j * self.indexer_region_stride + start_block * ix.block_bytes
        return self.buffer[start : start + num_blocks * ix.block_bytes]

    def region_offsets(self, slot: StagingSlot) -> list[int]:
        """Source offset of every region of `slot` in wire order (main layers, then indexer layers)."""
        out = [slot.offset + l * self.region_stride for l in range(self.layout.num_layers)]
        if self.layout.indexer is not None:
            out += [slot.offset + self.indexer_base + j * self.indexer_region_stride for j in range(len(self.layout.indexer.layers))]
        return out

    def segments(self, slot: StagingSlot, num_blocks: int, dst_base: int, dst_region_stride: int) -> list[tuple[int, int, int]]:
        """(src, dst, len) per layer for a request of `num_blocks` blocks."""
        n = num_blocks * self.layout.block_bytes
        return [
            (slot.offset + l * self.region_stride, dst_base + l * dst_region_stride, n)
            for l in range(self.layout.num_layers)
        ]


def gather_blocks(src_view: torch.Tensor, block_ids: torch.Tensor, dst_bytes: torch.Tensor,
                  block_perm: torch.Tensor | None = None, kt_v_dims: tuple[int, int, int] | None = None) -> None:
    """Copy blocks `block_ids` of one layer's physical-order view into `dst_bytes`, block after block.

    `src_view` is [num_blocks, d1, d2, C] whose dims follow memory order, so each
    gathered block is the block's bytes exactly as vLLM holds them; with `block_perm`
    each block's elements are reordered (wire = physical.flatten()[block_perm]).
    """
    raw = src_view.view(_INT_OF_SIZE[src_view.element_size()])
    n = block_ids.numel()
    if block_perm is None:
        out = dst_bytes.view(raw.dtype).view(n, *raw.shape[1:])
        if raw.device == out.device:
            torch.index_select(raw, 0, block_ids, out=out)
        else:  # device cache -> pinned host staging: gather on the device, one async copy out
            out.copy_(torch.index_select(raw, 0, block_ids.to(raw.device)), non_blocking=True)
        return
    elems = block_perm.numel()
    flat = torch.as_strided(raw, (raw.shape[0], elems), (raw.stride(0), 1))  # block interior is one run
    first = _contiguous_run(block_ids)
    # consecutive block ids (the usual case for a fresh allocation): unpack straight from the
    # cache, no intermediate gathered copy; otherwise one vectorised gather first
    packed = flat.narrow(0, first, n) if first is not None else torch.index_select(flat, 0, block_ids)
    out = dst_bytes.view(raw.dtype).view(n, elems)
    if kt_v_dims is not None and packed.device == out.device:
        from tilepd.connector.cpu_attn import unpack_kt_v

        unpack_kt_v(packed, out, *kt_v_dims)
    elif packed.device == out.device:
        torch.index_select(packed, 1, block_perm, out=out)
    else:
        out.copy_(torch.index_select(packed, 1, block_perm), non_blocking=True)


def _contiguous_run(block_ids: torch.Tensor) -> int | None:
    """The first id when `block_ids` is first, first+1, ...; else None."""
    n = block_ids.numel()
    if n == 0:
        return None
    first = int(block_ids[0])
    if int(block_ids[-1]) - first != n - 1:
        return None
    if n > 2 and not torch.equal(block_ids, torch.arange(first, first + n, dtype=block_ids.dtype, device=block_ids.device)):
        return None
    return first
