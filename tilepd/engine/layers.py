"""Small shared pieces of both decoders: RMSNorm, SwiGLU MLP, attention over a static cache with a length mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilepd.model_format.block_fp8 import BlockFp8
from tilepd.engine.fp8 import fp8_linear
from tilepd.engine.norm_act import rms_norm, silu_mul


def linear(x: torch.Tensor, w: torch.Tensor | BlockFp8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias). Every projection of the decoders goes through here, so the weight format
    (bf16/fp32 tensor, or block-scaled fp8: fp8.py) is decided in one place."""
    if isinstance(w, BlockFp8):
        return fp8_linear(x, w, bias)
    return F.linear(x, w, bias)


# "torch": the ops as written (cuBLAS GEMVs, element-wise kernels around them); "triton": batch-1 GEMVs of dense
# weights with the norm / SiLU-mul before them and the residual add after them fused in (gemv_triton.py, CUDA only;
# set by compiled.accelerate for Llama-family models).
GEMV_IMPL = {"dense": "torch"}


def _fused_gemv(x: torch.Tensor, w: torch.Tensor | BlockFp8) -> bool:
    if GEMV_IMPL["dense"] != "triton" or not x.is_cuda or isinstance(w, BlockFp8) or x.dim() != 2:
        return False
    from tilepd.engine import gemv_triton

    return gemv_triton.available() and x.shape[0] <= gemv_triton.MAX_ROWS


def norm_linear(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor | BlockFp8,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(rms_norm(x), w, bias): one kernel on the fused path (no bias)."""
    if bias is None and _fused_gemv(x, w):
        return torch.ops.tilepd.dense_gemv(x, w, norm_w, eps, "norm", None)
    return linear(rms_norm(x, norm_w, eps), w, bias)


def linear_add(residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor | BlockFp8) -> torch.Tensor:
    """residual + linear(x, w): the add rides in the GEMV on the fused path."""
    if _fused_gemv(x, w):
        return torch.ops.tilepd.dense_gemv(x, w, None, 0.0, "none", residual)
    return residual + linear(x, w)


def silu_mul_linear_add(residual: torch.Tensor, gu: torch.Tensor, w2: torch.Tensor | BlockFp8) -> torch.Tensor:
    """residual + linear(silu(gate) * up, w2) for gu = [gate | up]: one kernel on the fused path."""
    if _fused_gemv(gu, w2):
        return torch.ops.tilepd.dense_gemv(gu, w2, None, 0.0, "silu_mul", residual)
    return residual + linear(silu_mul(gu), w2)


def swiglu(x: torch.Tensor, w13: torch.Tensor | BlockFp8, w2: torch.Tensor | BlockFp8) -> torch.Tensor:
    """Gate and up projections fused in one GEMV (w13 = [gate; up]), then silu(gate) * up, then down."""
    return linear(silu_mul(linear(x, w13)), w2)


def length_mask(positions: torch.Tensor, attn_len: int) -> torch.Tensor:
    """[T, attn_len] bool: query at position p sees cache slots 0..p. Built on device from device positions."""
    slots = torch.arange(attn_len, device=positions.device)
    return slots[None, :] <= positions[:, None]


def attention_bias(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [group*T, L] (0 / -inf) for query rows ordered (group member, token); built once per
    step and shared by every layer, so no layer converts a bool mask itself."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(group, 1)


# "sdpa": torch's fused attention (on CUDA the memory-efficient kernel, which handles long caches well);
# "bmm": two batched GEMVs and a softmax, plain and portable; "triton": split-KV kernel (CUDA only, else
# sdpa). All read the cache in place. "mla": the DeepSeek-family latent attention, "reference" (the paths
# here and dsa.sparse_mla_attention) or "triton" (mla_attention.py, CUDA only; set by compiled.accelerate).
ATTENTION_IMPL = {"default": "sdpa", "mla": "reference"}


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
                     impl: str | None = None) -> torch.Tensor:
    """Grouped attention of T queries over a static cache window.

    q [T, H, Dk]; k [L, Hkv, Dk] and v [L, Hkv, Dv] may be strided views of the cache (no copy);
    bias [g*T, L] from attention_bias. Query heads of one KV group are stacked as query rows (GQA as MQA
    per group), so each K/V head is read once and no per-head copy of the cache is made. Returns [T, H, Dv].
    """
    impl = impl or ATTENTION_IMPL["default"]
    if impl == "triton" and q.is_cuda:  # split-KV kernel (attention.py); set by compiled.accelerate on CUDA
        from tilepd.engine.attention import split_kv_attention, supports

        if supports(q.shape[-1], v.shape[-1]):
            return split_kv_attention(q, k, v, bias, scale)
    if impl == "triton":
        impl = "sdpa"
    t, h, dk = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.view(t, hkv, g, dk).permute(1, 2, 0, 3).reshape(hkv, g * t, dk).to(k.dtype)
    kt, vt = k.permute(1, 0, 2), v.permute(1, 0, 2)  # [Hkv, L, D] views
    if impl == "sdpa":
        out = F.scaled_dot_product_attention(qg[None], kt[None], vt[None], attn_mask=bias.to(qg.dtype)[None, None], scale=scale)[0]
    else:
        scores = torch.matmul(qg * scale, kt.transpose(1, 2)).float() + bias  # [Hkv, g*T, L]
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, vt)  # [Hkv, g*T, Dv]
    return out.view(hkv, g, t, -1).permute(2, 0, 1, 3).reshape(t, h, -1)
