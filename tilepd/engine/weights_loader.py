"""Load tilepd runtime weights (a converted directory, or an HF checkpoint converted in memory) onto a device.

The engine's side of tilepd.weights: that package writes the format (and builds the tensors an in-memory
conversion loads here); the engine reads it through this module, so tilepd.weights imports nothing of the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tilepd.model_format.block_fp8 import DEFAULT_BLOCK, BlockFp8
from tilepd.engine.fp8 import device_supports_fp8, kernel_available
from tilepd.model_format.model_spec import ModelSpec, spec_from_hf_config
from tilepd.runbooks import see
from tilepd.weights import fp8_build
from tilepd.weights.build import build_chunks, cast_chunk
from tilepd.weights.out_tensors import family_layout
from tilepd.weights.manifest import MANIFEST, read_manifest
from tilepd.weights.source import Checkpoint, SafetensorsFile, WeightsError


Weights = dict[str, "torch.Tensor | BlockFp8"]


_SOURCE_FLOATS = (torch.bfloat16, torch.float32)


def _to_device(name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype, keep_fp32: set[str], source_float: set[str]) -> torch.Tensor:
    """A stored dense tensor on the device: keep_fp32 ones in float32 (HF's); source_float ones (the router gate) as
    stored when bf16 or float32 (an older conversion's float32 gate stays float32; never cast lossily to the model
    dtype: its users upcast it), else float32; the rest in the model dtype."""
    if name in keep_fp32:
        return t.to(device=device, dtype=torch.float32)
    if name in source_float:
        return t.to(device=device, dtype=t.dtype if t.dtype in _SOURCE_FLOATS else torch.float32)
    return t.to(device=device, dtype=dtype)


def check_fp8_device(device: torch.device, where: Path) -> None:
    """Refuse fp8 weights on a device that cannot multiply them (named), before anything is copied; on CUDA
    also load the GEMV kernel now, so compiled/captured code never imports it."""
    ok, why = device_supports_fp8(device)
    if not ok:
        raise WeightsError(f"{where}: holds block-scaled fp8 weights, but {why} - convert with --dtype bf16 for this GPU")
    if device.type == "cuda":
        kernel_available()


def load_weights(weights_dir: Path, device: torch.device, dtype: torch.dtype, rank: int = 0, tp: int = 1) -> tuple[ModelSpec, Weights]:
    """(spec, name -> device tensor or BlockFp8) of tensor-parallel rank `rank` of `tp`. A directory with
    manifest.json is read as converted weights (its tp must equal `tp`); an HF checkpoint (config.json +
    *.safetensors, no manifest) is converted in memory with the same layout and sharding. fp8 weights stay
    fp8 on the device (BlockFp8: values + block scales); `dtype` is the dense tensors' dtype."""
    if not 0 <= rank < tp:
        raise WeightsError(f"rank {rank} does not exist with tp={tp}")
    weights_dir = Path(weights_dir)
    manifest = read_manifest(weights_dir)
    if manifest is None:
        if (weights_dir / MANIFEST).exists():
            raise WeightsError(f"{weights_dir / MANIFEST}: not a tilepd weights manifest (re-run convert-weights)" + see("RB-weights-manifest"))
        if (weights_dir / "config.json").is_file():
            return _load_hf(weights_dir, device, dtype, rank, tp)
        raise WeightsError(f"{weights_dir}: neither converted weights (manifest.json) nor an HF checkpoint (config.json)")
    if manifest["tp"] != tp:
        raise WeightsError(f"{weights_dir}: converted for tp={manifest['tp']}, the decode node runs tp={tp} - "
                           f"re-run convert-weights with --tp {tp} (or set the node's tp_size to {manifest['tp']})" + see("RB-weights-manifest"))
    spec = spec_from_hf_config(manifest["model_config"], manifest.get("generation_config"))
    f = SafetensorsFile(weights_dir / f"rank{rank}.safetensors")
    want = set(manifest["layout"]["tensors"])
    if set(f.entries) != want:
        raise WeightsError(f"{f.path}: tensors differ from the manifest (missing {sorted(want - set(f.entries))[:5]})" + see("RB-weights-manifest"))
    tensors = manifest["layout"]["tensors"]
    fp8 = {name: tuple(tensors[name].get("block") or ()) for name in f.entries if name + ".scale" in f.entries}
    if fp8:
        unblocked = [n for n, b in fp8.items() if len(b) != 2]
        if unblocked:
            raise WeightsError(f"{weights_dir / MANIFEST}: fp8 tensor {unblocked[0]} has no block size (converted by an "
                               f"older tilepd with per-tensor scales) - re-run convert-weights" + see("RB-weights-manifest"))
        check_fp8_device(device, weights_dir)
    layout = family_layout(spec, set())
    keep_fp32 = {t.name for t in layout if t.keep_fp32}  # router bias, DSA weights_proj: float32 as in HF
    source_float = {t.name for t in layout if t.source_float}  # router gate: as stored (bf16 or float32)
    out: Weights = {}
    for name in f.entries:
        if name.endswith(".scale") and name.removesuffix(".scale") in fp8:
            continue
        t = f.read(name)
        if name in fp8:
            try:
                out[name] = BlockFp8(t, f.read(name + ".scale"), fp8[name]).to(device)
            except ValueError as e:
                raise WeightsError(f"{f.path}: {name}: {e}") from e
        else:
            out[name] = _to_device(name, t, device, dtype, keep_fp32, source_float)
    return spec, out


def _load_hf(model_dir: Path, device: torch.device, dtype: torch.dtype, rank: int = 0, tp: int = 1) -> tuple[ModelSpec, Weights]:
    """An HF checkpoint converted in memory; an fp8 checkpoint's GEMV weights stay fp8 (as convert-weights
    --dtype fp8 would store them), everything else as cast_chunk stores it (`dtype`; the router gate in its source's
    bf16 unless `dtype` is float32)."""
    with Checkpoint(model_dir) as ck:
        spec = spec_from_hf_config(ck.config(), ck.generation_config())
        source_block = ck.fp8_block()
        layout = family_layout(spec, ck.names())
        fp8 = {t.name for t in layout if fp8_build.stores_fp8(t, ck.is_fp8, source_block is not None, True)}
        if fp8:
            check_fp8_device(device, model_dir)
            get_fp8 = fp8_build.source_reader(ck.get_raw, source_block or DEFAULT_BLOCK)
        out: Weights = {}
        for t in layout:
            if t.name in fp8:
                block, _ = fp8_build.block_and_scale_shape(t, ck.shape, tp, source_block or DEFAULT_BLOCK)
                parts = list(fp8_build.build(t, get_fp8, block, rank, tp))
                w = BlockFp8(torch.stack([q.weight for q in parts]), torch.stack([q.scale for q in parts]), block) if t.stacked else parts[0]
                out[t.name] = w.to(device)
                continue
            chunks = [cast_chunk(t, c, dtype)[0] for c in build_chunks(t, ck.get, spec, rank, tp)]
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
