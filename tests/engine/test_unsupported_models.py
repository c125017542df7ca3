"""No silent substitution: a config feature that changes the math and that the engine lacks is refused by
name - by spec_from_hf_config (which validate calls), by convert-weights, and at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tilepd.dev.tiny_model import tiny_config
from tilepd.model_format.model_spec import UnsupportedModelError, spec_from_hf_config

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
REFUSED = {  # id: (model, changes, the key the message must name)
    "model-type": ("deepseek_v3", {"model_type": "deepseek_v4"}, "model_type='deepseek_v4'"),
    "scoring": ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    "topk-method": ("dsv32", {"topk_method": "greedy"}, "topk_method='greedy'"),
    "rope-type": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    "act": ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "quant-method": ("glm5", {"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config.quant_method='awq'"),
    "quant-block": ("glm5", {"quantization_config": {**FP8, "weight_block_size": [1, 128]}}, "quantization_config.weight_block_size"),
    "indexer-type": ("glm5", {"indexer_types": ["full", "compressed", "full"]}, "indexer_types=['compressed']"),
    "indexer-types-vs-vllm": ("glm5", {"indexer_types": ["full", "shared", "full"]}, "indexer_types="),
    "first-layer-shared": ("glm5", {"index_topk_pattern": "SFF", "indexer_types": None}, "index_topk_pattern='SFF'"),
    "glm-rope-half": ("glm5", {"indexer_rope_interleave": False}, "indexer_rope_interleave=False"),
    "dsv32-rope-pairs": ("dsv32", {"indexer_rope_interleave": True}, "indexer_rope_interleave=True"),
    "kpool": ("glm5", {"index_kpool": 4}, "index_kpool=4"),
    "dsa-on-v3": ("deepseek_v3", {"index_topk": 2048}, "index_topk=2048"),
    "mla-bias": ("dsv32", {"attention_bias": True}, "attention_bias=True"),
    "no-q-lora": ("dsv32", {"q_lora_rank": None}, "q_lora_rank=None"),
    "sliding-window": ("llama", {"sliding_window": 512}, "sliding_window=512"),
}


def _cfg(model: str, changes: dict) -> dict:
    cfg = {**tiny_config(model), **changes}
    return {k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_spec_refuses_by_name(case: str) -> None:
    model, changes, key = REFUSED[case]
    with pytest.raises(UnsupportedModelError) as e:
        spec_from_hf_config(_cfg(model, changes))
    assert key in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)


def test_spec_accepts_what_the_engine_implements() -> None:
    glm = spec_from_hf_config(_cfg("glm5", {"quantization_config": FP8}))
    assert glm.is_dsa and glm.indexer_rope_interleave and glm.indexer_types == ("full", "full", "shared")
    assert [glm.has_indexer(i) for i in range(4)] == [True, True, False, True]  # the MTP layer (3) always indexes
    pattern = spec_from_hf_config(_cfg("glm5", {"index_topk_pattern": "FSF", "indexer_types": None, "index_topk_freq": None}))
    assert pattern.indexer_types == ("full", "shared", "full")
    every = spec_from_hf_config(_cfg("glm5", {"indexer_types": None, "index_topk_freq": None}))
    assert every.indexer_types == ("full", "full", "full")
    v32 = spec_from_hf_config(tiny_config("dsv32"))
    assert (v32.index_topk, v32.index_n_heads, v32.index_head_dim, v32.indexer_rope_interleave) == (16, 8, 128, False)
    assert not spec_from_hf_config(tiny_config("deepseek_v3")).is_dsa
    qwen2 = {**tiny_config("llama"), "model_type": "qwen2", "sliding_window": 512, "use_sliding_window": False}
    assert spec_from_hf_config(qwen2).family == "llama"


@pytest.fixture
def bad_dsv32(tiny_dsv32: Path, tmp_path: Path) -> Path:
    """The tiny dsv32 checkpoint with softmax routing, which the engine does not implement."""
    out = tmp_path / "bad"
    shutil.copytree(tiny_dsv32, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "scoring_func": "softmax"}))
    return out


def test_convert_weights_refuses_by_name(bad_dsv32: Path, tmp_path: Path) -> None:
    from tilepd.cli.app import build_app

    r = CliRunner().invoke(build_app(), ["convert-weights", "--model-dir", str(bad_dsv32), "--out", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 4, r.output
    assert "scoring_func='softmax'" in r.output and "not implemented" in r.output
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_load_refuses_by_name(bad_dsv32: Path) -> None:
    from tilepd.engine import load_engine

    with pytest.raises(UnsupportedModelError, match="scoring_func='softmax'"):
        load_engine(bad_dsv32, device="cpu", max_seq_len=64, dtype="float32")


def test_tiny_model_cli_writes_dsa_models(tmp_path: Path) -> None:
    from tilepd.cli.app import build_app

    for name, model_type in (("glm5", "glm_moe_dsa"), ("dsv32", "deepseek_v32")):
        r = CliRunner().invoke(build_app(), ["dev", "tiny-model", name, str(tmp_path / name), "--json"])
        assert r.exit_code == 0, r.output
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["model_type"] == model_type and cfg["index_topk"] == 16
        assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576 and cfg["num_nextn_predict_layers"] == 1
