"""Small shared pieces of both decoders: RMSNorm, SwiGLU MLP, attention over a static cache with a length mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (statistics accumulated in float32); one fused kernel where torch has one (CUDA, torch >= 2.8)."""
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Gate and up projections fused in one GEMV (w13 = [gate; up]), then silu(gate) * up, then down."""
    gu = F.linear(x, w13)
    g, u = gu.chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w2)


def length_mask(positions: torch.Tensor, attn_len: int) -> torch.Tensor:
    """[T, attn_len] bool: query at position p sees cache slots 0..p. Built on device from device positions."""
    slots = torch.arange(attn_len, device=positions.device)
    return slots[None, :] <= positions[:, None]


# "sdpa": torch's fused attention (on CUDA the memory-efficient kernel, which handles long caches well);
# "bmm": two batched GEMVs and a softmax, plain and portable. Both read the cache in place.
ATTENTION_IMPL = {"default": "sdpa"}


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     impl: str | None = None) -> torch.Tensor:
    """Grouped attention of T queries over a static cache window.

    q [T, H, Dk]; k [L, Hkv, Dk] and v [L, Hkv, Dv] may be strided views of the cache (no copy);
    mask [T, L]. Query heads of one KV group are stacked as query rows (GQA as MQA per group), so each
    K/V head is read once and no per-head expansion of the cache is materialised. Returns [T, H, Dv].
    """
    t, h, dk = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.view(t, hkv, g, dk).permute(1, 2, 0, 3).reshape(hkv, g * t, dk).to(k.dtype)
    kt, vt = k.permute(1, 0, 2), v.permute(1, 0, 2)  # [Hkv, L, D] views
    if (impl or ATTENTION_IMPL["default"]) == "sdpa":
        rows_mask = mask.repeat(g, 1)  # rows ordered (group member, token)
        out = F.scaled_dot_product_attention(qg[None], kt[None], vt[None], attn_mask=rows_mask[None, None], scale=scale)[0]
    else:
        scores = torch.matmul(qg * scale, kt.transpose(1, 2)).float()  # [Hkv, g*T, L]
        scores = scores.view(hkv, g, t, -1).masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(hkv, g * t, -1)
        out = torch.matmul(probs, vt)  # [Hkv, g*T, Dv]
    return out.view(hkv, g, t, -1).permute(2, 0, 1, 3).reshape(t, h, -1)
