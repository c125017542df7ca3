"""Block-scaled fp8 weights (DeepSeek-V3 / GLM-5 checkpoints): e4m3 values, one float32 scale per block.

A checkpoint's `weight_scale_inv` holds one scale per 128x128 block (`quantization_config.weight_block_size`):
    weight[r, c] = fp8[r, c] * scale[r // block_n, c // block_k].
tilepd keeps exactly those values and scales on the device (no re-quantisation, no dequantisation at load),
so a GEMV reads 1 byte per weight. Fusing parts whose row counts are not multiples of block_n (tiny models,
some TP shards) repeats each row's scales instead (block_n = 1): still the source's values and scales.

The format alone (`BlockFp8`, `quantize`, `dequantize`): the converter (tilepd.weights) writes it and the
engine multiplies by it (tilepd.engine.fp8, the kernel in fp8_triton.py), so both import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
DEFAULT_BLOCK = (128, 128)


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
