"""The torch-free fast path of convert-weights: resolve the options and decide whether to skip.

Kept apart from the converter so a re-run with unchanged inputs reads two JSON files and stats the
sources (see manifest.py for the rule) without importing torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tilepd.weights.errors import WeightsError
from tilepd.weights.manifest import is_up_to_date, read_manifest, write_manifest_atomically

DTYPE_CHOICES = ("bf16", "fp16", "fp32", "fp8")


def read_spec(model_dir: Path):
    """ModelSpec of an HF checkpoint's config.json, with file-named errors."""
    from tilepd.model_format.model_spec import spec_from_hf_config

    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise WeightsError(f"{model_dir}: no config.json (not an HF checkpoint directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{cfg_path}:{e.lineno}: invalid JSON ({e.msg})") from e
    try:
        return spec_from_hf_config(cfg)
    except (KeyError, ValueError) as e:
        raise WeightsError(f"{cfg_path}: {e}") from e


def resolve_options(model_dir: Path, family: str | None, dtype: str, tp: int) -> dict[str, Any]:
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    spec = read_spec(model_dir)
    if family is not None and spec.family != family:
        raise WeightsError(f"{model_dir}/config.json: model_type {spec.model_type!r} is family {spec.family!r}, not {family!r}")
    return {"family": spec.family, "dtype": dtype, "tp": tp}


def try_skip(model_dir: Path, out_dir: Path, options: dict[str, Any]) -> bool:
    """True when out_dir already holds this conversion (the manifest is refreshed if only mtimes moved)."""
    skip, refreshed = is_up_to_date(read_manifest(out_dir), Path(model_dir), Path(out_dir), options)
    if skip and refreshed is not None:
        write_manifest_atomically(out_dir, refreshed)
    return skip
