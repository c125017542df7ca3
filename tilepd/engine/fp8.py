"""Block-scaled fp8 weights (DeepSeek-V3 / GLM-5 checkpoints): e4m3 values, one float32 scale per block.

A checkpoint's `weight_scale_inv` holds one scale per 128x128 block (`quantization_config.weight_block_size`):
    weight[r, c] = fp8[r, c] * scale[r // block_n, c // block_k].
tilepd keeps exactly those values and scales on the device (no re-quantisation, no dequantisation at load),
so a GEMV reads 1 byte per weight. Fusing parts whose row counts are not multiples of block_n (tiny models,
some TP shards) repeats each row's scales instead (block_n = 1): still the source's values and scales.

`fp8_linear` / `fp8_expert_linear` multiply bf16 (or fp32) activations by such weights. On CUDA with
Triton, a GEMV kernel (fp8_triton.py) reads fp8 + scales and accumulates in float32, as a torch custom op
so torch.compile treats it as one opaque call and CUDA graphs capture it (no host sync). Elsewhere (CPU,
or more tokens than a GEMV is for) the weight is dequantised into a temporary per call: the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
DEFAULT_BLOCK = (128, 128)
GEMV_MAX_ROWS = 8  # above this many tokens, dequantise and use a dense matmul instead (the GEMV re-reads W per token)


@dataclass(frozen=True)
class BlockFp8:
    """fp8 e4m3 weight [out, in] (or stacked experts [E, out, in]) with float32 block scales
    [..., ceil(out/block_n), ceil(in/block_k)]."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8:
            raise ValueError(f"BlockFp8 weight must be float8_e4m3fn, got {self.weight.dtype}")
        bn, bk = self.block
        *lead, n, k = self.weight.shape
        want = (*lead, -(-n // bn), -(-k // bk))
        if tuple(self.scale.shape) != want:
            raise ValueError(f"BlockFp8 scale shape {list(self.scale.shape)} does not match weight {list(self.weight.shape)} "
                             f"with block {list(self.block)} (expected {list(want)})")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * self.scale.element_size()

    def to(self, device: torch.device | str) -> "BlockFp8":
        return BlockFp8(self.weight.to(device), self.scale.to(device=device, dtype=torch.float32), self.block)

    def __getitem__(self, ids: torch.Tensor) -> "BlockFp8":
        """Experts selected by device indices (gathers fp8 values and their scales; no host sync)."""
        return BlockFp8(self.weight[ids], self.scale[ids], self.block)


def expand_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """[..., nb_r, nb_c] block scales -> [..., rows, cols], one per element."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]


def dequantize(w: BlockFp8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 * scale in float32, then cast to `dtype`."""
    n, k = w.weight.shape[-2:]
    return (w.weight.float() * expand_scale(w.scale.float(), n, k, w.block)).to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> BlockFp8:
    """A bf16/fp32 [out, in] weight -> e4m3 with one scale per block: scale = amax(|block|) / 448, as
    DeepSeek-V3's fp8 checkpoints were made (an all-zero block gets scale 0 and zero values)."""
    if w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D weight, got shape {list(w.shape)}")
    bn, bk = block
    n, k = w.shape
    nb_r, nb_c = -(-n // bn), -(-k // bk)
    x = F.pad(w.float(), (0, nb_c * bk - k, 0, nb_r * bn - n))
    blocks = x.view(nb_r, bn, nb_c, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    q = (blocks / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return BlockFp8(q.view(nb_r * bn, nb_c * bk)[:n, :k].to(FP8).contiguous(), scale.contiguous(), block)


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
