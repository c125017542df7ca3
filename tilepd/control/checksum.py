"""Per-region checksums of a KV transfer (protocol v2): the sender hashes what it staged, the decode node
what landed, and a difference fails the request before anything is decoded from it.

xxh3_64 because it runs near memory speed on one core (bench/checksum_cost.py; docs/PERFORMANCE.md) and
releases the GIL, so regions hash in parallel threads and alongside the transport's own threads.
A region of a device (CUDA) buffer is copied to host memory first.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch
import xxhash

ALGORITHM = "xxh3_64"
_PARALLEL_MIN_BYTES = 4 << 20  # below this, threads cost more than they save
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="kv-checksum")
    return _pool


def digest(data: torch.Tensor) -> str:
    """xxh3_64 of a contiguous uint8 tensor's bytes, as 16 hex digits."""
    if data.device.type != "cpu":
        data = data.cpu()
    return f"{xxhash.xxh3_64_intdigest(data.contiguous().numpy()):016x}"


def region_digests(buf: torch.Tensor, regions: Sequence[tuple[int, int]]) -> list[str]:
    """Digest of each (offset, length) byte range of the uint8 tensor `buf`, in order."""
    views = [buf[off:off + n] for off, n in regions]
    if sum(n for _, n in regions) < _PARALLEL_MIN_BYTES or len(views) < 2:
        return [digest(v) for v in views]
    return list(_executor().map(digest, views))


def first_mismatch(want: Sequence[str], got: Sequence[str]) -> int | None:
    """Index of the first region whose digest differs (or len of the shorter list when counts differ)."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))
