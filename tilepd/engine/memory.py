"""What a loaded model holds in memory, logged once at start (weights by format; per-GPU allocator figures)."""

from __future__ import annotations

import logging

import torch

from tilepd.model_format.block_fp8 import BlockFp8

log = logging.getLogger(__name__)
GIB = 1024**3


def weight_bytes(weights: dict) -> dict[str, int]:
    """Bytes of a weights dict by storage format: {"fp8": values + block scales, "dense": everything else}."""
    out = {"fp8": 0, "dense": 0}
    for w in weights.values():
        if isinstance(w, BlockFp8):
            out["fp8"] += w.nbytes()
        else:
            out["dense"] += w.numel() * w.element_size()
    return out


def log_memory(weights: dict, device: torch.device) -> dict[str, float]:
    """Log (and return, in GiB) the weights' bytes and, on CUDA, torch's allocated/reserved memory and the
    device's free/total memory: the operator sees what the node holds before the first request."""
    wb = weight_bytes(weights)
    fig = {"weights_fp8_gib": wb["fp8"] / GIB, "weights_dense_gib": wb["dense"] / GIB}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        fig |= {"allocated_gib": torch.cuda.memory_allocated(device) / GIB, "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
                "free_gib": free / GIB, "total_gib": total / GIB}
    log.info("event=engine_memory device=%s %s", device, " ".join(f"{k}={v:.3f}" for k, v in fig.items()))
    return fig
