"""fp8 GEMVs of block-scaled fp8 weights (the format: tilepd.model_format.block_fp8).

`fp8_linear` / `fp8_expert_linear` multiply bf16 (or fp32) activations by such weights. On CUDA with
Triton, a GEMV kernel (fp8_triton.py) reads fp8 + scales and accumulates in float32, as a torch custom op
so torch.compile treats it as one opaque call and CUDA graphs capture it (no host sync). Elsewhere (CPU,
or more tokens than a GEMV is for) the weight is dequantised into a temporary per call: the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilepd.model_format.block_fp8 import BlockFp8, dequantize

GEMV_MAX_ROWS = 8  # above this many tokens, dequantise and use a dense matmul instead (the GEMV re-reads W per token)


def device_supports_fp8(device: torch.device) -> tuple[bool, str]:
    """(ok, why not). CPU: always (reference path). CUDA: e4m3 arithmetic needs compute capability 8.9+."""
    if device.type == "cpu":
        return True, ""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return True, ""
        return False, f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; fp8 e4m3 GEMV needs sm_89 or newer (Ada, Hopper, Blackwell)"
    return False, f"device type {device.type!r} has no fp8 path in tilepd"


_KERNEL: dict[str, bool] = {}


def kernel_available() -> bool:
    """Import the Triton kernel module once (registers `tilepd::fp8_gemv`); the loader calls this before
    any compiled or captured code runs, so the dispatch below only reads a flag."""
    if "ok" not in _KERNEL:
        from tilepd.engine import fp8_triton

        _KERNEL["ok"] = fp8_triton.available()
    return _KERNEL["ok"]


def _use_kernel(x: torch.Tensor, tokens: int) -> bool:
    if not x.is_cuda or tokens > GEMV_MAX_ROWS:
        return False
    return kernel_available()


def fp8_linear(x: torch.Tensor, w: BlockFp8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ dequant(w).T (+ bias) -> [..., out] in x's dtype, float32 accumulation."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if _use_kernel(x2, x2.shape[0]):
        y = torch.ops.tilepd.fp8_gemv(x2, w.weight, w.scale, None, bias, w.block[0], w.block[1])
    else:
        y = F.linear(x2, dequantize(w, x.dtype), bias)
    return y.reshape(*lead, w.weight.shape[-2])


def fp8_expert_linear(x: torch.Tensor, w: BlockFp8, ids: torch.Tensor) -> torch.Tensor:
    """Per token and selected expert: x [T, k, in] (or [T, in], shared by the k experts) times expert
    ids[t, j]'s weight -> [T, k, out]. The kernel reads each selected expert in place by its device id."""
    t, k = ids.shape
    xs = x if x.dim() == 3 else x[:, None, :].expand(t, k, x.shape[-1])
    if _use_kernel(x, t):  # each (token, expert) row reads its own expert: the bound is on tokens
        y = torch.ops.tilepd.fp8_gemv(xs.reshape(t * k, -1), w.weight, w.scale, ids.reshape(-1), None, w.block[0], w.block[1])
        return y.view(t, k, -1)
    sel = dequantize(w[ids], x.dtype)  # [T, k, out, in]
    return torch.einsum("tki,tkoi->tko", xs, sel)
