"""convert-weights --dtype fp8: an fp8 source kept exactly (values and block scales), a bf16 source quantised
to what its fp8 release would hold, the manifest's format, the bytes saved, TP shards, device refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tilepd.dev.fp8_checkpoint import is_quantised, write_fp8_checkpoint
from tilepd.model_format.block_fp8 import FP8, BlockFp8, quantize
from tilepd.weights import WeightsError, convert_weights
from tilepd.weights import fp8_build
from tilepd.weights.out_tensors import OutTensor
from tilepd.engine.weights_loader import load_weights
from tilepd.weights.source import Checkpoint, SafetensorsFile


def _dequant(w: BlockFp8) -> torch.Tensor:
    n, k = w.weight.shape[-2:]
    r, c = torch.arange(n) // w.block[0], torch.arange(k) // w.block[1]
    return w.weight.float() * w.scale.float()[..., r[:, None], c[None, :]]


@pytest.fixture(scope="module")
def deepseek_fp8(tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fp8_checkpoint(tiny_deepseek, tmp_path_factory.mktemp("ds") / "hf-fp8")


def test_fp8_checkpoint_looks_like_the_real_releases(deepseek_fp8: Path) -> None:
    cfg = json.loads((deepseek_fp8 / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with Checkpoint(deepseek_fp8) as ck:
        names = ck.names()
        assert ck.is_fp8("model.layers.1.mlp.experts.3.down_proj.weight") and ck.is_fp8("model.layers.0.self_attn.kv_b_proj.weight")
        for dense in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight", "model.layers.2.eh_proj.weight",
                      "model.layers.0.input_layernorm.weight"):
            assert dense in names and not ck.is_fp8(dense), dense
        assert ck.shape("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv") == (5, 1)  # 576 x 128: partial row block
    assert not is_quantised("model.layers.0.self_attn.indexer.weights_proj.weight") and is_quantised("model.layers.0.self_attn.indexer.wk.weight")


def test_fp8_source_is_kept_bit_exact(deepseek_fp8: Path, tmp_path: Path) -> None:
    convert_weights(deepseek_fp8, tmp_path / "w", dtype="fp8", progress=False)
    f = SafetensorsFile(tmp_path / "w" / "rank0.safetensors")
    m = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert m["weight_format"] == "fp8-block" and m["layout"]["tensors"]["layers.0.wkv_a"]["block"] == [128, 128]
    with Checkpoint(deepseek_fp8) as ck:
        raw = ck.get_raw
        for out, src in [("layers.0.wkv_a", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), ("layers.1.wo", "model.layers.1.self_attn.o_proj.weight"),
                         ("layers.0.wq_b", "model.layers.0.self_attn.q_b_proj.weight")]:
            w, s = raw(src)
            assert f.entries[out][0] == FP8
            assert torch.equal(f.read(out).view(torch.uint8), w.view(torch.uint8)), out
            assert torch.equal(f.read(out + ".scale"), s), out
        e_w, e_s = f.read("layers.1.experts_w2"), f.read("layers.1.experts_w2.scale")
        w5, s5 = raw("model.layers.1.mlp.experts.5.down_proj.weight")
        assert torch.equal(e_w[5].view(torch.uint8), w5.view(torch.uint8)) and torch.equal(e_s[5], s5)
        # Fused parts (gate; up of 64 rows each: not block multiples) repeat each row's scales: same values.
        assert m["layout"]["tensors"]["layers.1.experts_w13"]["block"] == [1, 128]
        fused = _dequant(BlockFp8(f.read("layers.1.experts_w13")[2], f.read("layers.1.experts_w13.scale")[2], (1, 128)))
        parts = [BlockFp8(*raw(f"model.layers.1.mlp.experts.2.{p}_proj.weight"), (128, 128)) for p in ("gate", "up")]
        assert torch.equal(fused, torch.cat([_dequant(p) for p in parts]))
        # kv_b_proj is dequantised for W_UK / W_UV, as vLLM's MLA does at load.
        assert f.entries["layers.0.w_uk"][0] == torch.bfloat16
    # Loading the HF fp8 checkpoint directly gives the same device weights as the conversion.
    _, direct = load_weights(deepseek_fp8, torch.device("cpu"), torch.float32)
    _, conv = load_weights(tmp_path / "w", torch.device("cpu"), torch.float32)
    assert direct.keys() == conv.keys()
    for k, v in direct.items():
        if isinstance(v, BlockFp8):
            assert isinstance(conv[k], BlockFp8) and v.block == conv[k].block and torch.equal(v.scale, conv[k].scale), k
            assert torch.equal(v.weight.view(torch.uint8), conv[k].weight.view(torch.uint8)), k
        else:
            assert torch.allclose(v, conv[k], rtol=1e-2, atol=1e-3), k  # bf16-stored dense tensors vs fp32 direct


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_deepseek"])
def test_bf16_source_quantised_like_its_fp8_release_and_half_the_bytes(fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    src: Path = request.getfixturevalue(fixture)
    convert_weights(src, tmp_path / "q", dtype="fp8", progress=False)
    convert_weights(write_fp8_checkpoint(src, tmp_path / "hf-fp8"), tmp_path / "k", dtype="fp8", progress=False)
    convert_weights(src, tmp_path / "b", dtype="bf16", progress=False)
    q, k, b = (SafetensorsFile(tmp_path / d / "rank0.safetensors") for d in "qkb")
    assert q.entries.keys() == k.entries.keys()
    for name in q.entries:  # bf16 -> fp8 here equals the fp8 release's conversion, byte for byte, except
        if name.endswith(("w_uk", "w_uv")):  # kv_b_proj, dense either way: the release's is its fp8 dequantised
            continue
        assert torch.equal(q.read(name).view(torch.uint8), k.read(name).view(torch.uint8)), name
    fp8_names = [n for n in q.entries if q.entries[n][0] == FP8]
    assert len(fp8_names) >= 8
    fp8_bytes = sum(q.entries[n][3] - q.entries[n][2] + q.entries[n + ".scale"][3] - q.entries[n + ".scale"][2] for n in fp8_names)
    bf16_bytes = sum(b.entries[n][3] - b.entries[n][2] for n in fp8_names)
    assert 0.5 <= fp8_bytes / bf16_bytes < 0.52, fp8_bytes / bf16_bytes  # 1 byte per weight + float32 scales
    total_q, total_b = (tmp_path / "q" / "rank0.safetensors").stat().st_size, (tmp_path / "b" / "rank0.safetensors").stat().st_size
    dense_bytes = total_b - bf16_bytes
    assert total_q < dense_bytes + 0.52 * bf16_bytes  # what is not a GEMV weight (embeddings, head, norms) stays as it was


def test_tp_shards_keep_block_scales_or_refuse_clearly(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    src = {"a": quantize(torch.randn(256, 512, generator=g)), "b": quantize(torch.randn(192, 512, generator=g)),
           "o": quantize(torch.randn(256, 512, generator=g))}
    full = {k: _dequant(v) for k, v in src.items()}
    shape_of = lambda n: tuple(src[n].weight.shape)  # noqa: E731
    fused = OutTensor("ab", (("a", "b"),), shard_dim=0, quantizable=True)
    block, scale_shape = fp8_build.block_and_scale_shape(fused, shape_of, 2, (128, 128))
    assert block == (1, 128) and scale_shape == (224, 4)  # b's 96-row shards start mid-block: per-row scales
    for rank in range(2):
        (w,) = fp8_build.build(fused, src.__getitem__, block, rank, 2)
        want = torch.cat([full["a"].chunk(2)[rank], full["b"].chunk(2)[rank]])
        assert tuple(w.scale.shape) == scale_shape and torch.equal(_dequant(w), want)
    row = OutTensor("o", (("o",),), shard_dim=1, quantizable=True)
    block, scale_shape = fp8_build.block_and_scale_shape(row, shape_of, 2, (128, 128))
    assert block == (128, 128) and scale_shape == (2, 2)
    for rank in range(2):
        (w,) = fp8_build.build(row, src.__getitem__, block, rank, 2)
        assert torch.equal(_dequant(w), full["o"].chunk(2, dim=1)[rank])
    with pytest.raises(WeightsError, match=r"o: 512 input columns split 8 ways do not start on fp8 block boundaries"):
        fp8_build.block_and_scale_shape(row, shape_of, 8, (128, 128))


def test_fp8_weights_on_a_device_without_fp8_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    convert_weights(tiny_llama, tmp_path / "w", dtype="fp8", progress=False)
    with pytest.raises(WeightsError, match=r"holds block-scaled fp8 weights, but device type 'meta' has no fp8 path.*--dtype bf16"):
        load_weights(tmp_path / "w", torch.device("meta"), torch.bfloat16)


def test_other_quantisations_are_refused_by_name(tiny_llama: Path, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "awq"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((WeightsError, ValueError), match="quant_method"):
        convert_weights(d, tmp_path / "w", dtype="fp8", progress=False)
