"""The deployment fingerprint of a checkpoint (tilepd.contracts.fingerprint) and where the converter records it."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tilepd.contracts.fingerprint import (
    CheckpointIdentity,
    Fingerprint,
    FingerprintError,
    checkpoint_identity,
    compare,
    differences,
)
from tilepd.dev.tiny_model import make_tiny_model
from tilepd.weights.convert import convert_weights
from tilepd.weights.manifest import MANIFEST, node_fingerprint


@pytest.fixture(scope="module")
def two_llamas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny Llamas of one architecture (same config, tokenizer and shapes) with other values."""
    return (make_tiny_model("llama", tmp_path_factory.mktemp("seed0"), seed=0),
            make_tiny_model("llama", tmp_path_factory.mktemp("seed1"), seed=1))


def _safetensors_header(path: Path) -> bytes:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8:8 + n]


def test_same_shapes_other_values_differ_in_weights_only(two_llamas: tuple[Path, Path]) -> None:
    a, b = two_llamas
    assert _safetensors_header(a / "model.safetensors") == _safetensors_header(b / "model.safetensors")  # same shapes
    ia, ib = checkpoint_identity(a), checkpoint_identity(b)
    assert differences(ia, ib) == ["weights"] and ia.id != ib.id
    assert checkpoint_identity(a) == ia  # deterministic


def test_one_changed_tensor_is_seen_and_json_whitespace_is_not(two_llamas: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = two_llamas
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(reversed(list(cfg.items()))), indent=7))  # same content, other text
    assert checkpoint_identity(copy) == checkpoint_identity(a)
    # one byte in the middle of the last tensor (its middle window) changes the weights part
    path = copy / "model.safetensors"
    header = json.loads(_safetensors_header(path))
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    begin, end = header[name]["data_offsets"]
    raw = bytearray(path.read_bytes())
    mid = 8 + len(_safetensors_header(path)) + begin + (end - begin - 64) // 2
    raw[mid] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert differences(checkpoint_identity(a), checkpoint_identity(copy)) == ["weights"]
    cfg["rms_norm_eps"] = 1e-3
    (copy / "config.json").write_text(json.dumps(cfg))
    assert differences(checkpoint_identity(a), checkpoint_identity(copy)) == ["weights", "config"]


def test_a_truncated_checkpoint_is_a_clear_error(two_llamas: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = two_llamas
    bad = tmp_path / "bad"
    shutil.copytree(a, bad)
    raw = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(FingerprintError, match="model.safetensors: tensor .* ends past the file"):
        checkpoint_identity(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(FingerprintError, match="no \\*.safetensors files"):
        checkpoint_identity(bad)


def test_compare_names_both_sides_and_what_differs(two_llamas: tuple[Path, Path]) -> None:
    a, b = two_llamas
    prefill = Fingerprint(role="prefill", checkpoint=checkpoint_identity(a), facts={"vllm_version": "0.32.0", "kv_cache_dtype": "auto"})
    node = Fingerprint(role="decode", checkpoint=checkpoint_identity(b), facts={"converter_version": "2", "weights_dtype": "bf16"})
    msg = compare(prefill, node, "d7")
    assert msg is not None and prefill.id in msg and node.id in msg and "decode node d7" in msg
    assert "differ in weights" in msg and "vllm_version 0.32.0" in msg and "converter_version 2" in msg
    assert compare(prefill, prefill.model_copy(update={"role": "decode"})) is None
    assert compare(None, node) is None and compare(prefill, None) is None  # one side reports none: not compared
    unknown = Fingerprint(role="decode", checkpoint=None)
    assert "manifest predates fingerprints" in (compare(prefill, unknown) or "")


def test_the_converter_records_the_identity_and_the_node_reports_it(two_llamas: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = two_llamas
    out = tmp_path / "w"
    convert_weights(a, out, dtype="fp32", progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert CheckpointIdentity.model_validate(manifest["source_identity"]) == checkpoint_identity(a)
    fp = node_fingerprint(out, "float32")
    assert fp.checkpoint == checkpoint_identity(a)
    assert fp.facts == {"converter_version": manifest["converter_version"], "layout_version": str(manifest["layout_version"]),
                        "weights_dtype": "fp32"}
    # an HF checkpoint the node converts in memory is identified directly
    direct = node_fingerprint(a, "float32")
    assert direct.checkpoint == fp.checkpoint and direct.facts["converter_version"] == "in-memory"


def test_a_skipped_reconversion_adds_the_identity_to_an_older_manifest(two_llamas: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = two_llamas
    out = tmp_path / "w"
    convert_weights(a, out, dtype="fp32", progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["source_identity"]  # as an older converter wrote it
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert node_fingerprint(out, "float32").checkpoint is None
    before = (out / "rank0.safetensors").stat().st_mtime_ns
    assert convert_weights(a, out, dtype="fp32", progress=False).skipped
    assert (out / "rank0.safetensors").stat().st_mtime_ns == before  # not converted again
    assert node_fingerprint(out, "float32").checkpoint == checkpoint_identity(a)


def test_the_module_prints_a_directory_identity(two_llamas: tuple[Path, Path]) -> None:
    a, _ = two_llamas
    out = subprocess.run([sys.executable, "-m", "tilepd.contracts.fingerprint", str(a)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["id"] == checkpoint_identity(a).id and seen["weights"] == checkpoint_identity(a).weights
    missing = subprocess.run([sys.executable, "-m", "tilepd.contracts.fingerprint", str(a / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "no config.json" in json.loads(missing.stdout)["error"]
