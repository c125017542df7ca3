"""The MoE router gate is stored in its checkpoint's own dtype: a bf16 source stays bf16 (half the bytes a decode step
reads, the same float32 logits once upcast), an fp32 source stays fp32 (never narrowed); the loader keeps it as stored,
an older conversion (fp32 gate, converter 2) is re-done, and the memory plan counts the bytes the converter writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tilepd.engine.weights_loader import load_weights
from tilepd.model_format.model_spec import spec_from_hf_config
from tilepd.topology.memory_fit import checkpoint_dtype, decode_policy, weight_bytes
from tilepd.weights import convert_weights
from tilepd.weights.out_tensors import OutTensor
from tilepd.weights.source import SafetensorsFile

GATES = ("layers.1.gate", "mtp.0.gate")  # tiny DeepSeek-V3: layer 1 is MoE, and the MTP layer


def _is_gate(name: str) -> bool:
    return name.endswith(".mlp.gate.weight")


def bf16_gate_copy(src: Path, out: Path, config_dtype: str | None = "bfloat16") -> Path:
    """Checkpoint `src` with its router gates stored bf16 (as DeepSeek-V3.x and GLM-5.1 store them), the rest as is;
    config.json's dtype set to `config_dtype` (None: unchanged)."""
    out.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    gates = [n for n in tensors if _is_gate(n)]
    assert gates and all(tensors[n].dtype == torch.float32 for n in gates)
    save_file({n: t.to(torch.bfloat16) if _is_gate(n) else t for n, t in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, out / f.name)
    if config_dtype is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["torch_dtype"] = config_dtype
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


@pytest.fixture(scope="module")
def bf16_gate(tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bf16_gate_copy(tiny_deepseek, tmp_path_factory.mktemp("bf16-gate") / "hf")


def _source_gate(src: Path, layer: int) -> torch.Tensor:
    return load_file(str(src / "model.safetensors"))[f"model.layers.{layer}.mlp.gate.weight"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8"])
def test_bf16_source_gate_is_written_bf16(bf16_gate: Path, tmp_path: Path, dtype: str) -> None:
    convert_weights(bf16_gate, tmp_path / "w", dtype=dtype, progress=False)
    f = SafetensorsFile(tmp_path / "w" / "rank0.safetensors")
    tensors = json.loads((tmp_path / "w" / "manifest.json").read_text())["layout"]["tensors"]
    for name, layer in zip(GATES, (1, 2)):
        assert f.entries[name][0] == torch.bfloat16 and tensors[name]["dtype"] == "bfloat16", (name, dtype)
        assert torch.equal(f.read(name), _source_gate(bf16_gate, layer)), name  # the checkpoint's bits
    # the router's correction bias stays float32 (HF and vLLM keep it so), the other dense tensors follow --dtype
    assert f.entries["layers.1.gate_bias"][0] == torch.float32
    assert f.entries["layers.1.attn_norm"][0] == (torch.float16 if dtype == "fp16" else torch.bfloat16)


def test_fp32_conversion_and_fp32_source_keep_a_float32_gate(bf16_gate: Path, tiny_deepseek: Path, tmp_path: Path) -> None:
    convert_weights(bf16_gate, tmp_path / "fp32", dtype="fp32", progress=False)  # a float32 conversion is float32 throughout
    f = SafetensorsFile(tmp_path / "fp32" / "rank0.safetensors")
    assert f.entries["layers.1.gate"][0] == torch.float32
    assert torch.equal(f.read("layers.1.gate"), _source_gate(bf16_gate, 1).float())
    convert_weights(tiny_deepseek, tmp_path / "bf16", dtype="bf16", progress=False)  # an fp32 source gate is never narrowed
    f = SafetensorsFile(tmp_path / "bf16" / "rank0.safetensors")
    for name, layer in zip(GATES, (1, 2)):
        assert f.entries[name][0] == torch.float32, name
        assert torch.equal(f.read(name), _source_gate(tiny_deepseek, layer)), name
    assert f.entries["layers.1.wo"][0] == torch.bfloat16


def test_tp_ranks_hold_the_same_bf16_gate(bf16_gate: Path, tmp_path: Path) -> None:
    convert_weights(bf16_gate, tmp_path / "w", dtype="bf16", tp=2, progress=False)
    for r in range(2):
        f = SafetensorsFile(tmp_path / "w" / f"rank{r}.safetensors")
        assert f.entries["layers.1.gate"][0] == torch.bfloat16
        assert torch.equal(f.read("layers.1.gate"), _source_gate(bf16_gate, 1)), r


def test_loader_keeps_the_gate_as_stored(bf16_gate: Path, tiny_deepseek: Path, tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    convert_weights(bf16_gate, tmp_path / "new", dtype="bf16", progress=False)
    _, w = load_weights(tmp_path / "new", cpu, torch.float32)  # a float32 engine: bf16 weights upcast, the gate kept bf16
    assert w["layers.1.gate"].dtype == torch.bfloat16 and torch.equal(w["layers.1.gate"], _source_gate(bf16_gate, 1))
    assert w["layers.1.gate_bias"].dtype == torch.float32 and w["layers.1.wo"].dtype == torch.float32
    # an fp32 gate (an fp32 source, or a conversion by converter 2) stays float32 on a bf16 engine: never cast lossily
    convert_weights(tiny_deepseek, tmp_path / "old", dtype="bf16", progress=False)
    _, w = load_weights(tmp_path / "old", cpu, torch.bfloat16)
    assert w["layers.1.gate"].dtype == torch.float32 and torch.equal(w["layers.1.gate"], _source_gate(tiny_deepseek, 1))
    assert w["layers.1.wo"].dtype == torch.bfloat16
    # an HF checkpoint converted in memory: as convert-weights would store it for the engine's dtype
    _, w = load_weights(bf16_gate, cpu, torch.bfloat16)
    assert w["layers.1.gate"].dtype == torch.bfloat16 and w["mtp.0.gate"].dtype == torch.bfloat16
    _, w = load_weights(bf16_gate, cpu, torch.float32)
    assert w["layers.1.gate"].dtype == torch.float32 and torch.equal(w["layers.1.gate"], _source_gate(bf16_gate, 1).float())


def test_a_conversion_by_the_previous_converter_is_redone(bf16_gate: Path, tmp_path: Path) -> None:
    """Converter 2 widened the gate to float32; its output would still load, but re-converting halves the gate's bytes."""
    out = tmp_path / "w"
    convert_weights(bf16_gate, out, dtype="bf16", progress=False)
    assert convert_weights(bf16_gate, out, dtype="bf16", progress=False).skipped
    m = json.loads((out / "manifest.json").read_text())
    assert m["layout_version"] == 2
    (out / "manifest.json").write_text(json.dumps({**m, "converter_version": "2", "layout_version": 1}))
    assert not convert_weights(bf16_gate, out, dtype="bf16", progress=False).skipped
    assert SafetensorsFile(out / "rank0.safetensors").entries["layers.1.gate"][0] == torch.bfloat16


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("source", ["fp32", "bf16-gate"])
def test_memory_plan_counts_the_bytes_the_converter_writes(source: str, tp: int, bf16_gate: Path, tiny_deepseek: Path, tmp_path: Path) -> None:
    src = bf16_gate if source == "bf16-gate" else tiny_deepseek
    convert_weights(src, tmp_path / "w", dtype="bf16", tp=tp, progress=False)
    cfg = json.loads((src / "config.json").read_text())
    assert checkpoint_dtype(cfg) == ("bfloat16" if source == "bf16-gate" else "float32")
    main, mtp = weight_bytes(spec_from_hf_config(cfg), tp, decode_policy("bf16", checkpoint_dtype(cfg)))
    for r in range(tp):
        f = SafetensorsFile(tmp_path / "w" / f"rank{r}.safetensors")
        written = sum(end - begin for _, _, begin, end in f.entries.values())
        assert main + mtp == written, (source, tp, r, main + mtp, written)
    gate = decode_policy("bf16", checkpoint_dtype(cfg))(OutTensor("layers.1.gate", (("g",),), source_float=True), (8, 128))
    assert gate == 8 * 128 * (2 if source == "bf16-gate" else 4)


def test_source_float_is_one_dense_source_by_name() -> None:
    with pytest.raises(ValueError, match="layers.1.gate: source_float is for one dense source"):
        OutTensor("layers.1.gate", (("a", "b"),), source_float=True)
    with pytest.raises(ValueError, match="x: source_float"):
        OutTensor("x", (("a",),), source_float=True, keep_fp32=True)
