"""The prefill's fp8 KV-cache scales, read from vLLM's attention layers, for the layout the hello carries.

vLLM stores an fp8 (e4m3) cache entry as value / scale. The scale comes from the checkpoint (e.g. a
compressed-tensors `kv_cache_scheme`, or an fp8 checkpoint's `k_scale` / `v_scale` tensors) and is fixed
once the weights are loaded (`BaseKVCacheMethod.process_weights_after_loading`,
vllm/model_executor/layers/quantization/kv_cache.py), before `register_kv_caches` runs. Each attention
layer keeps it as `_k_scale_float` / `_v_scale_float` (and the tensors `_k_scale` / `_v_scale`); an MLA
layer quantises its whole latent entry (latent and rope part) with the one `_k_scale`
(`concat_and_cache_mla(..., scale=k_scale)`). A checkpoint without scales leaves 1.0.

Per-head scales (compressed-tensors strategy `attn_head`: `_k_scale` holds one value per KV head of this
rank) are refused: the wire layout carries one scale per layer, the same on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tilepd.connector.paged_cache import UnsupportedCacheLayout
from tilepd.control.cache_layout import CacheLayout

Scales = tuple[float, ...]


def _layer_scale(name: str, layer: Any, which: str) -> float:
    """One layer's per-tensor scale `which` ("k" or "v"), as vLLM uses it in its cache kernels."""
    tensor = getattr(layer, f"_{which}_scale", None)
    if tensor is not None and getattr(tensor, "numel", lambda: 1)() > 1:
        values = [float(x) for x in tensor.detach().flatten().tolist()]
        if len(set(values)) > 1:
            raise UnsupportedCacheLayout(
                f"layer {name}: per-head fp8 KV scales (_{which}_scale holds {len(values)} values, a compressed-tensors "
                "kv_cache_scheme with strategy attn_head); the hand-off carries one scale per layer: use a checkpoint "
                "with per-tensor KV scales, or --kv-cache-dtype auto")
        return values[0]
    value = getattr(layer, f"_{which}_scale_float", None)
    if value is None:
        raise UnsupportedCacheLayout(f"layer {name}: the attention layer has no _{which}_scale_float; cannot read the fp8 KV "
                                     "scale vLLM quantises this layer's cache with")
    return float(value)


def read_kv_scales(layer_names: Sequence[str], layers: Mapping[str, Any], layout: CacheLayout) -> tuple[Scales | None, Scales | None]:
    """(k_scales, v_scales) per layer in layout order for an fp8_e4m3 cache, (None, None) when every scale is 1.0
    (or the cache is not plain fp8): the hello then stays what a node that predates KV scales reads.

    `layers`: vLLM's static forward context (layer name -> attention layer object).
    """
    if layout.dtype != "fp8_e4m3":
        return None, None
    missing = [n for n in layer_names if layers.get(n) is None]
    if missing:
        raise UnsupportedCacheLayout(f"fp8 KV cache: no attention layer registered under {missing[:3]} in vLLM's forward "
                                     "context; cannot read the KV scales the cache was written with")
    k = tuple(_layer_scale(n, layers[n], "k") for n in layer_names)
    if layout.kind == "mla":
        return (None, None) if all(s == 1.0 for s in k) else (k, None)
    v = tuple(_layer_scale(n, layers[n], "v") for n in layer_names)
    if all(s == 1.0 for s in k + v):
        return None, None
    return k, v


def with_kv_scales(layout: CacheLayout, layer_names: Sequence[str], layers: Mapping[str, Any]) -> CacheLayout:
    """`layout` carrying the prefill's fp8 KV scales (unchanged when there are none to carry)."""
    k, v = read_kv_scales(layer_names, layers, layout)
    if k is None:
        return layout
    try:
        return CacheLayout.model_validate({**layout.model_dump(), "k_scales": k, "v_scales": v})
    except ValueError as exc:
        raise UnsupportedCacheLayout(f"fp8 KV scales: {exc}") from exc
