"""Load tilepd runtime weights (a converted directory, or an HF checkpoint converted in memory) onto a device."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tilepd.engine.spec import ModelSpec, spec_from_hf_config
from tilepd.weights.build import FP8, build_chunks, cast_chunk
from tilepd.weights.layout import family_layout
from tilepd.weights.manifest import MANIFEST, read_manifest
from tilepd.weights.source import Checkpoint, SafetensorsFile, WeightsError


def _to_device(name: str, t: torch.Tensor, scale: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == FP8:
        # Dequantised once at load: batch-1 decode then reads `dtype` weights (fp8 GEMV kernels: later work).
        s = scale.to(device).float()
        w = t.to(device).float()
        return (w * s.view(-1, *([1] * (w.dim() - 1))) if w.dim() == 3 else w * s).to(dtype)
    keep = name.endswith(("gate", "gate_bias"))
    return t.to(device=device, dtype=torch.float32 if keep else dtype)


def load_weights(weights_dir: Path, device: torch.device, dtype: torch.dtype, rank: int = 0, tp: int = 1) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(spec, name -> device tensor) of tensor-parallel rank `rank` of `tp`. A directory with manifest.json
    is read as converted weights (its tp must equal `tp`); an HF checkpoint (config.json + *.safetensors,
    no manifest) is converted in memory with the same layout and sharding."""
    if not 0 <= rank < tp:
        raise WeightsError(f"rank {rank} does not exist with tp={tp}")
    weights_dir = Path(weights_dir)
    manifest = read_manifest(weights_dir)
    if manifest is None:
        if (weights_dir / MANIFEST).exists():
            raise WeightsError(f"{weights_dir / MANIFEST}: not a tilepd weights manifest (re-run convert-weights)")
        if (weights_dir / "config.json").is_file():
            return _load_hf(weights_dir, device, dtype, rank, tp)
        raise WeightsError(f"{weights_dir}: neither converted weights (manifest.json) nor an HF checkpoint (config.json)")
    if manifest["tp"] != tp:
        raise WeightsError(f"{weights_dir}: converted for tp={manifest['tp']}, the decode node runs tp={tp} - "
                           f"re-run convert-weights with --tp {tp} (or set the node's tp_size to {manifest['tp']})")
    spec = spec_from_hf_config(manifest["model_config"], manifest.get("generation_config"))
    f = SafetensorsFile(weights_dir / f"rank{rank}.safetensors")
    want = set(manifest["layout"]["tensors"])
    if set(f.entries) != want:
        raise WeightsError(f"{f.path}: tensors differ from the manifest (missing {sorted(want - set(f.entries))[:5]})")
    out = {}
    for name in f.entries:
        if name.endswith(".scale"):
            continue
        scale = f.read(name + ".scale") if name + ".scale" in f.entries else None
        out[name] = _to_device(name, f.read(name), scale, device, dtype)
    return spec, out


def _load_hf(model_dir: Path, device: torch.device, dtype: torch.dtype, rank: int = 0, tp: int = 1) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    with Checkpoint(model_dir) as ck:
        spec = spec_from_hf_config(ck.config(), ck.generation_config())
        out = {}
        for t in family_layout(spec, ck.names()):
            chunks = [cast_chunk(t, c, dtype, False)[0] for c in build_chunks(t, ck.get, spec, rank, tp)]
            x = torch.stack(chunks) if t.stacked else chunks[0]
            out[t.name] = x.to(device)
    return spec, out


def read_spec(weights_dir: Path) -> ModelSpec:
    m = read_manifest(Path(weights_dir))
    if m is not None:
        return spec_from_hf_config(m["model_config"], m.get("generation_config"))
    cfg = json.loads((Path(weights_dir) / "config.json").read_text())
    gen_p = Path(weights_dir) / "generation_config.json"
    return spec_from_hf_config(cfg, json.loads(gen_p.read_text()) if gen_p.is_file() else None)
