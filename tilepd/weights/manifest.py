"""manifest.json of a converted-weights directory: what was converted from what, written last and atomically.

Skip rule (re-running `convert-weights` with the same inputs): the manifest must exist with the same
converter version, family, dtype and tp; every source file must have the recorded size, and every
output file its recorded size. If a source's mtime also matches, it is trusted without hashing (so a
re-run takes well under a second); if only the mtime changed (touch, copy), its sha256 is recomputed
and compared, so content decides. Anything else re-converts.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tilepd.contracts.fingerprint import CheckpointIdentity, Fingerprint, checkpoint_identity

MANIFEST = "manifest.json"
FORMAT = "tilepd-weights"
# 2: fp8 tensors carry block scales (1 had one scale per tensor); 3: the MoE router gate is stored in its source's dtype,
# bf16 for the served checkpoints (2 widened it to float32: out_tensors LAYOUT_VERSION 2), so an older output re-converts
CONVERTER_VERSION = "3"


def sha256_file(path: Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def source_entry(path: Path, root: Path) -> dict[str, Any]:
    st = path.stat()
    return {"file": str(path.relative_to(root)), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


def source_files(model_dir: Path) -> list[Path]:
    """Files whose content defines the conversion: weights and the configs."""
    names = sorted(model_dir.glob("*.safetensors")) + [p for p in (model_dir / "config.json", model_dir / "generation_config.json") if p.is_file()]
    return names


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    p = Path(out_dir) / MANIFEST
    if not p.is_file():
        return None
    try:
        m = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return m if isinstance(m, dict) and m.get("format") == FORMAT else None


def write_manifest_atomically(out_dir: Path, manifest: dict[str, Any]) -> None:
    tmp = Path(out_dir) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, Path(out_dir) / MANIFEST)


def is_up_to_date(manifest: dict[str, Any] | None, model_dir: Path, out_dir: Path, options: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """(skip?, refreshed manifest when only mtimes moved and hashes still match)."""
    if manifest is None or manifest.get("converter_version") != CONVERTER_VERSION or manifest.get("options") != options:
        return False, None
    recorded = {s["file"]: s for s in manifest.get("sources", [])}
    current = source_files(model_dir)
    if sorted(str(p.relative_to(model_dir)) for p in current) != sorted(recorded):
        return False, None
    for out in manifest.get("files", []):
        p = out_dir / out["file"]
        if not p.is_file() or p.stat().st_size != out["size"]:
            return False, None
    refreshed = False
    for p in current:
        rec = recorded[str(p.relative_to(model_dir))]
        st = p.stat()
        if st.st_size != rec["size"]:
            return False, None
        if st.st_mtime_ns != rec["mtime_ns"]:
            if sha256_file(p) != rec["sha256"]:
                return False, None
            rec["mtime_ns"] = st.st_mtime_ns
            refreshed = True
    return True, (manifest if refreshed else None)


def node_fingerprint(weights_dir: Path, engine_dtype: str) -> Fingerprint:
    """A decode node's fingerprint (tilepd.contracts.fingerprint): the source identity its manifest recorded, with the
    converter's facts; an HF checkpoint the node converts in memory at load is identified directly."""
    weights_dir = Path(weights_dir)
    m = read_manifest(weights_dir)
    if m is None:
        from tilepd.weights.out_tensors import LAYOUT_VERSION

        return Fingerprint(role="decode", checkpoint=checkpoint_identity(weights_dir),
                           facts={"converter_version": "in-memory", "layout_version": str(LAYOUT_VERSION), "weights_dtype": engine_dtype})
    recorded = m.get("source_identity")
    try:
        identity = CheckpointIdentity.model_validate(recorded) if recorded else None
    except ValueError:
        identity = None
    facts = {"converter_version": str(m.get("converter_version")), "layout_version": str(m.get("layout_version")),
             "weights_dtype": str(m.get("weight_format") or m.get("dtype"))}
    return Fingerprint(role="decode", checkpoint=identity, facts=facts)
