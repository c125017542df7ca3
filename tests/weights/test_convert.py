"""convert-weights: engine parity, idempotence, change detection, corruption, interruption, TP layout, fp8."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tilepd.contracts.exit_codes import ExitCode
from tilepd.engine import KVState, SamplingParams, load_engine
from tilepd.weights import WeightsError, convert_weights
from tilepd.weights.source import SafetensorsFile


def _cli(python_exe: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([python_exe, "-m", "tilepd", "convert-weights", *args], capture_output=True, text=True, timeout=timeout)


def _greedy(weights_dir: Path, n: int = 12) -> list[int]:
    torch.manual_seed(0)
    eng = load_engine(weights_dir, device="cpu", max_seq_len=64, dtype="float32", num_speculative_tokens=0)
    s = eng.config
    eng.inject(KVState(5, [torch.randn(5, s.cache_heads, s.cache_entry_width) for _ in range(s.num_layers)]))
    return eng.decode(3, n, SamplingParams(ignore_eos=True), lambda t: None).tokens


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_deepseek"])
def test_converted_weights_decode_like_the_hf_checkpoint(fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    src: Path = request.getfixturevalue(fixture)
    r = convert_weights(src, tmp_path / "w", dtype="fp32", progress=False)
    assert not r.skipped and r.files == ["rank0.safetensors"]
    m = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert m["converter_version"] and m["model_config"]["model_type"] in ("llama", "deepseek_v3")
    assert {s["file"] for s in m["sources"]} >= {"model.safetensors", "config.json"}
    assert all(len(s["sha256"]) == 64 for s in m["sources"])
    assert _greedy(tmp_path / "w") == _greedy(src)


@pytest.mark.slow
def test_second_run_skips_and_touch_rehashes(tiny_llama: Path, tmp_path: Path, python_exe: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in tiny_llama.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "w"
    first = _cli(python_exe, "--model-dir", str(src), "--out", str(out), "--dtype", "fp32", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["skipped"] is False
    before = (out / "manifest.json").read_text()
    second = _cli(python_exe, "--model-dir", str(src), "--out", str(out), "--dtype", "fp32", "--json")
    info = json.loads(second.stdout)
    print(f"second run: skipped={info['skipped']} in {info['seconds']} s (inside the process)")
    assert info["skipped"] is True and (out / "manifest.json").read_text() == before
    # Same bytes, new mtime: hashes decide, still skipped; the manifest records the new mtime.
    os.utime(src / "model.safetensors", ns=(time.time_ns(), time.time_ns() + 10**9))
    r = convert_weights(src, out, dtype="fp32", progress=False)
    assert r.skipped and (out / "manifest.json").read_text() != before
    # Other options are another conversion.
    assert not convert_weights(src, out, dtype="bf16", progress=False).skipped


def test_changed_source_reconverts(tmp_path: Path) -> None:
    from tilepd.dev.tiny_model import make_tiny_model

    src = make_tiny_model("llama", tmp_path / "src", seed=1)
    out = tmp_path / "w"
    convert_weights(src, out, dtype="fp32", progress=False)
    old = json.loads((out / "manifest.json").read_text())
    old_tokens = _greedy(out)
    make_tiny_model("llama", src, seed=2)  # same names and sizes, different content
    r = convert_weights(src, out, dtype="fp32", progress=False)
    assert not r.skipped
    new = json.loads((out / "manifest.json").read_text())
    digest = lambda m: {s["file"]: s["sha256"] for s in m["sources"]}  # noqa: E731
    assert digest(new)["model.safetensors"] != digest(old)["model.safetensors"]
    assert _greedy(out) != old_tokens


def _copy_with(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["missing", "nan", "shape", "truncated"])
def test_corrupt_checkpoint_is_a_clear_error_and_leaves_no_manifest(fault: str, tiny_llama: Path, tmp_path: Path, python_exe: str) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    edits = {
        "missing": lambda t: t.pop(name),
        "nan": lambda t: t[name].view(-1).__setitem__(7, float("nan")),
        "shape": lambda t: t.__setitem__(name, t[name][:-1].clone()),
        "truncated": lambda t: None,
    }
    src = _copy_with(tiny_llama, tmp_path / "src", edits[fault])
    if fault == "truncated":
        data = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[: len(data) - 1000])
    out = tmp_path / "w"
    convert_weights(tiny_llama, out, dtype="fp32", progress=False)  # a previous good conversion
    r = _cli(python_exe, "--model-dir", str(src), "--out", str(out), "--dtype", "fp32")
    print(r.stderr.strip())
    assert r.returncode == ExitCode.INPUT
    expect = {"missing": name, "nan": "NaN", "shape": "layers.1.w13", "truncated": "truncated"}[fault]
    assert expect in r.stderr and "no manifest written" in r.stderr
    assert not (out / "manifest.json").exists()
    with pytest.raises(WeightsError):
        load_engine(out, device="cpu", max_seq_len=16)


@pytest.mark.slow
def test_interrupted_conversion_leaves_no_manifest_and_next_run_completes(tmp_path: Path, python_exe: str) -> None:
    from tilepd.dev.synthetic import make_synthetic_llama

    src = make_synthetic_llama(tmp_path / "src", hidden=1024, layers=8, intermediate=4096, vocab=8192, shard_bytes=200 << 20)
    out = tmp_path / "w"
    proc = subprocess.Popen([python_exe, "-m", "tilepd", "convert-weights", "--model-dir", str(src), "--out", str(out), "--dtype", "bf16", "--json"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tmp = out / "rank0.safetensors.tmp"
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp.exists() and tmp.stat().st_size > 1 << 20):
        time.sleep(0.005)
    assert proc.poll() is None, "conversion finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (out / "manifest.json").exists() and not (out / "rank0.safetensors").exists()
    r = convert_weights(src, out, dtype="bf16", progress=False)
    assert not r.skipped and (out / "manifest.json").is_file() and not tmp.exists()
    assert convert_weights(src, out, dtype="bf16", progress=False).skipped


def test_tp_shards_split_fused_tensors_per_part(tiny_llama: Path, tmp_path: Path) -> None:
    convert_weights(tiny_llama, tmp_path / "tp1", dtype="fp32", progress=False)
    convert_weights(tiny_llama, tmp_path / "tp2", dtype="fp32", tp=2, progress=False)
    full = SafetensorsFile(tmp_path / "tp1" / "rank0.safetensors")
    ranks = [SafetensorsFile(tmp_path / "tp2" / f"rank{r}.safetensors") for r in range(2)]
    cfg = json.loads((tiny_llama / "config.json").read_text())
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    wqkv = full.read("layers.0.wqkv")
    q, k, v = wqkv.split([nh * hd, nkv * hd, nkv * hd])
    for r, f in enumerate(ranks):
        expect = torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]])
        assert torch.equal(f.read("layers.0.wqkv"), expect)
        assert torch.equal(f.read("layers.0.wo"), full.read("layers.0.wo").chunk(2, dim=1)[r])
        g, u = full.read("layers.0.w13").chunk(2)
        assert torch.equal(f.read("layers.0.w13"), torch.cat([g.chunk(2)[r], u.chunk(2)[r]]))
        assert torch.equal(f.read("norm"), full.read("norm"))
    with pytest.raises(WeightsError, match="tp=2"):  # a tp=2 conversion on a one-rank engine: refuse, do not mis-load
        load_engine(tmp_path / "tp2", device="cpu", max_seq_len=16)


def test_fp8_weights_dequantise_close(tiny_deepseek: Path, tmp_path: Path) -> None:
    from tilepd.model_format.block_fp8 import BlockFp8, dequantize
    from tilepd.engine.weights_loader import load_weights

    convert_weights(tiny_deepseek, tmp_path / "fp8", dtype="fp8", progress=False)
    f = SafetensorsFile(tmp_path / "fp8" / "rank0.safetensors")
    assert f.entries["layers.1.experts_w13"][0] == torch.float8_e4m3fn
    assert f.entries["layers.1.experts_w13.scale"][1] == (8, 128, 1)  # per expert; gate/up rows (64) repeat their block scale
    assert f.entries["layers.1.experts_w2.scale"][1] == (8, 1, 1)  # one 128x128 block per [128, 64] expert
    _, w8 = load_weights(tmp_path / "fp8", torch.device("cpu"), torch.float32)
    _, w32 = load_weights(tiny_deepseek, torch.device("cpu"), torch.float32)
    for name in ("layers.0.wkv_a", "layers.1.experts_w13", "layers.1.wo"):
        assert isinstance(w8[name], BlockFp8), name
        rel = float((dequantize(w8[name]) - w32[name]).norm() / w32[name].norm())
        assert rel < 0.05, (name, rel)
    assert torch.equal(w8["layers.1.gate_bias"], w32["layers.1.gate_bias"])


@pytest.mark.slow
def test_topology_form_converts_once_per_weights_path(tmp_path: Path, repo_root: Path, python_exe: str) -> None:
    text = (repo_root / "topology_examples" / "local.yaml").read_text().replace("~/.local/state/tilepd/local", str(tmp_path / "dep"))
    topo = tmp_path / "local.yaml"
    topo.write_text(text)
    r = _cli(python_exe, str(topo), "--local", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines) == 1 and lines[0]["dtype"] == "fp32" and lines[0]["skipped"] is False
    weights = tmp_path / "dep" / "models" / "tiny-llama-tilepd"
    assert (weights / "manifest.json").is_file()
    again = _cli(python_exe, str(topo), "--local", "--json")
    assert json.loads(again.stdout.splitlines()[0])["skipped"] is True
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("apiVersion: tilepd/v1", "apiVersion: tilepd/v9"))
    assert _cli(python_exe, str(bad), "--local").returncode == ExitCode.INVALID


def test_tp_shards_deepseek_split_heads_and_expert_columns(tiny_deepseek: Path, tmp_path: Path) -> None:
    convert_weights(tiny_deepseek, tmp_path / "tp1", dtype="fp32", progress=False)
    convert_weights(tiny_deepseek, tmp_path / "tp2", dtype="fp32", tp=2, progress=False)
    full = SafetensorsFile(tmp_path / "tp1" / "rank0.safetensors")
    for r in range(2):
        f = SafetensorsFile(tmp_path / "tp2" / f"rank{r}.safetensors")
        for name, dim in (("layers.1.w_uk", 0), ("layers.1.w_uv", 0), ("layers.1.wq_b", 0), ("layers.1.wo", 1), ("layers.1.experts_w2", 2)):
            assert torch.equal(f.read(name), full.read(name).chunk(2, dim=dim)[r]), name
        g, u = full.read("layers.1.experts_w13").chunk(2, dim=1)
        assert torch.equal(f.read("layers.1.experts_w13"), torch.cat([g.chunk(2, dim=1)[r], u.chunk(2, dim=1)[r]], dim=1))
        for name in ("layers.1.wkv_a", "layers.1.gate", "layers.1.gate_bias", "layers.1.kv_a_norm"):
            assert torch.equal(f.read(name), full.read(name)), name
