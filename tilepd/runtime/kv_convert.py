"""The decode node's KV conversion: received bytes (vLLM paged layout, INTERFACES §2) -> the engine layout's KV layers (§1).

The prefill side ships blocks as vLLM holds them; this is the one place the decode
node reorders them: per layer, view the region as [blocks, H, bs, C] (BHNC) or
[blocks, bs, H, C] (BNHC), make it token-major [seq_len, H, C], and cast to the
engine's cache dtype. Plain fp8 (fp8_e4m3) entries are multiplied by the layer's KV scales the
prefill sent in its layout (vLLM stores value / scale; a checkpoint's scales are not 1.0 in
general, so assuming 1.0 would decode from KV off by that factor). fp8_ds_mla tokens (512 fp8 + 4 fp32 scales + 64 bf16 rope)
are dequantised here, and so are a DSA model's indexer keys (fp8 values + one fp32
scale per 128): the engine's indexer reads dequantised keys, so its top-k sees
exactly the values vLLM's prefill indexer scored (tests compare against HF run with
the same fp8-round-tripped keys).
"""

from __future__ import annotations

import torch

from tilepd.control.cache_layout import INDEXER_QUANT_GROUP, CacheLayout, IndexerLayout

WIRE_TORCH_DTYPE: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}

_DS_LATENT = 512
_DS_GROUP = 128


def _dequant_fp8_ds_mla(tok_bytes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[T, 656] uint8 -> [T, 576]: latent fp8 * per-128 scale, then bf16 rope."""
    t = tok_bytes.shape[0]
    latent = tok_bytes[:, :_DS_LATENT].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scales = tok_bytes[:, _DS_LATENT:_DS_LATENT + 16].contiguous().view(torch.float32)  # [T, 4]
    latent = (latent.view(t, _DS_LATENT // _DS_GROUP, _DS_GROUP) * scales.unsqueeze(-1)).view(t, _DS_LATENT)
    rope = tok_bytes[:, _DS_LATENT + 16:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat([latent, rope], dim=-1).to(out_dtype)


def layer_bytes(buf: torch.Tensor, layout: CacheLayout, max_seq_len: int, layer: int, num_blocks: int,
                rank: int = 0) -> torch.Tensor:
    """The uint8 slice of the receive buffer holding `num_blocks` blocks of `layer` sent by TP rank `rank`."""
    stride = layout.region_stride(max_seq_len)
    start = (rank * layout.num_layers + layer) * stride
    return buf[start:start + num_blocks * layout.block_bytes]


def convert_layer(raw: torch.Tensor, layout: CacheLayout, seq_len: int, out_dtype: torch.dtype,
                  device: torch.device | str | None = None, scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """One layer's received bytes -> [seq_len, num_heads, width] in `out_dtype` on `device`.

    `scales`: the layer's (k, v) fp8 scales (`CacheLayout.layer_scales`); an MLA latent uses k for its whole entry.
    """
    nb = layout.blocks_for(seq_len)
    if device is not None:
        raw = raw.to(device, non_blocking=True)
    if layout.dtype == "fp8_ds_mla":
        per = raw.view(nb, layout.block_size, layout.entry_width)  # one head: BHNC == BNHC
        return _dequant_fp8_ds_mla(per.reshape(nb * layout.block_size, layout.entry_width)[:seq_len], out_dtype).unsqueeze(1)
    x = raw.view(WIRE_TORCH_DTYPE[layout.dtype])
    h, bs, c = layout.num_heads, layout.block_size, layout.entry_width
    if layout.order == "BHNC":
        x = x.view(nb, h, bs, c).permute(0, 2, 1, 3)
    else:
        x = x.view(nb, bs, h, c)
    x = x.reshape(nb * bs, h, c)[:seq_len]
    if x.dtype == torch.float8_e4m3fn:
        x = x.to(torch.float32)
        k, v = scales
        if layout.kind == "attn" and (k, v) != (1.0, 1.0):
            hk = layout.head_size_k or 0
            x[..., :hk] *= k
            x[..., hk:] *= v
        elif k != 1.0:
            x *= k
    return x.to(out_dtype).contiguous()


def convert(buf: torch.Tensor, layout: CacheLayout, max_seq_len: int, seq_len: int, out_dtype: torch.dtype,
            device: torch.device | str | None = None, tp_size: int = 1) -> list[torch.Tensor]:
    """All layers of one received transfer, in the engine layout.

    With tp_size > 1 rank r's heads sit in their own regions (after the r-1 ranks before it) and are
    concatenated in rank order, which is how tensor parallelism splits KV heads.
    """
    nb = layout.blocks_for(seq_len)
    out = []
    for l in range(layout.num_layers):
        parts = [convert_layer(layer_bytes(buf, layout, max_seq_len, l, nb, r), layout, seq_len, out_dtype, device,
                               layout.layer_scales(l)) for r in range(tp_size)]
        out.append(parts[0] if tp_size == 1 else torch.cat(parts, dim=1))
    return out


def to_wire(layers: list[torch.Tensor], layout: CacheLayout) -> bytes:
    """Inverse of `convert` for float and fp8_e4m3 wire dtypes: engine-layout [T, H, C] layers -> contiguous wire blocks.

    Used by tests and the bench to produce what a vLLM prefill would send.
    """
    out = []
    for l, x in enumerate(layers):
        t, h, c = x.shape
        nb = layout.blocks_for(t)
        pad = torch.zeros(nb * layout.block_size, h, c, dtype=WIRE_TORCH_DTYPE[layout.dtype])
        k, v = layout.layer_scales(l)
        if (k, v) != (1.0, 1.0):  # vLLM stores value / scale in an fp8 cache
            x = x.to(torch.float32).clone()
            hk = (layout.head_size_k or 0) if layout.kind == "attn" else c  # mla: k scales the whole entry
            x[..., :hk] /= k
            x[..., hk:] /= v
        pad[:t] = x.to(pad.dtype)
        blocks = pad.view(nb, layout.block_size, h, c)
        if layout.order == "BHNC":
            blocks = blocks.permute(0, 2, 1, 3)
        out.append(blocks.contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(out)


def dequant_indexer_blocks(raw: torch.Tensor, ix: IndexerLayout, seq_len: int, out_dtype: torch.dtype) -> torch.Tensor:
    """One layer's indexer blocks (uint8, `blocks_for(seq_len) * block_bytes`) -> [seq_len, head_dim] keys.

    Block interior as vLLM's `indexer_k_quant_and_cache` writes it (CUDA, non-shuffled; the Triton reference
    vllm/v1/attention/ops/rocm_aiter_mla_sparse.py:176-214 with block_size 1 spells it out): `block_size`
    tokens x head_dim fp8 e4m3 values, then `block_size` x head_dim/128 fp32 scales; key = fp8 * scale.
    """
    nb, bs, d = ix.blocks_for(seq_len), ix.block_size, ix.head_dim
    g = d // INDEXER_QUANT_GROUP
    blocks = raw.view(nb, ix.block_bytes)
    vals = blocks[:, : bs * d].contiguous().view(torch.float8_e4m3fn).view(nb, bs, g, INDEXER_QUANT_GROUP).to(torch.float32)
    scales = blocks[:, bs * d:].contiguous().view(torch.float32).view(nb, bs, g, 1)
    return (vals * scales).view(nb * bs, d)[:seq_len].to(out_dtype)


def convert_indexer(buf: torch.Tensor, layout: CacheLayout, max_seq_len: int, seq_len: int, out_dtype: torch.dtype,
                    device: torch.device | str | None = None) -> list[torch.Tensor | None] | None:
    """A DSA transfer's indexer keys per layout layer ([seq_len, head_dim], None for a layer without an indexer
    cache: GLM's "shared" layers reuse the previous layer's top-k); None when the layout has no indexer."""
    ix = layout.indexer
    if ix is None:
        return None
    base, stride, n = layout.indexer_base(max_seq_len), ix.region_stride(max_seq_len), ix.blocks_for(seq_len) * ix.block_bytes
    out: list[torch.Tensor | None] = [None] * layout.num_layers
    for j, l in enumerate(ix.layers):
        raw = buf[base + j * stride: base + j * stride + n]
        if device is not None:
            raw = raw.to(device, non_blocking=True)
        out[l] = dequant_indexer_blocks(raw, ix, seq_len, out_dtype)
    return out

