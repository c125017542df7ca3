"""Rule model-config: a config.json readable at hf_path whose features the engine does not implement is refused at
validate, located at model.hf_path (or model.family) with the config.json path and key; a good one feeds memory-fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tilepd.cli.app import app
from tilepd.topology import TopologyError, load_topology_text
from tilepd.topology.known_models import KNOWN_MODELS

BASE = (Path(__file__).parent / "base_valid.yaml").read_text()
HF_LINE = 9  # "  hf_path: /models/tiny" in base_valid.yaml


def tiny_dsv3() -> dict[str, Any]:
    """DeepSeek-V3's config.json with tiny shapes (so that only the feature under test can fail)."""
    cfg = {k: v for k, v in KNOWN_MODELS["deepseek-ai/DeepSeek-V3"].config.items() if k != "quantization_config"}
    cfg.update(vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
               q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
    return cfg


def _load(tmp_path: Path, cfg: dict[str, Any] | str) -> tuple[str, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return BASE.replace("  hf_path: /models/tiny\n", f"  hf_path: {model}\n"), model / "config.json"


def _findings(text: str) -> list:
    with pytest.raises(TopologyError) as info:
        load_topology_text(text, "t.yaml")
    return info.value.findings


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config.quant_method='awq': only block-scaled fp8"),
        ({"model_type": "mamba2"}, "model_type='mamba2': not supported"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax': MoE routing not implemented"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
    ids=["awq", "model-type", "routing", "activation"],
)
def test_unimplemented_feature_is_refused_with_path_and_key(tmp_path: Path, change: dict[str, Any], words: str) -> None:
    text, cfg_path = _load(tmp_path, {**tiny_dsv3(), **change})
    (finding,) = _findings(text)
    assert (finding.rule, finding.path, finding.line) == ("model-config", "model.hf_path", HF_LINE)
    assert finding.message.startswith(f"{cfg_path}: ") and words in finding.message
    assert "refuses the model rather than decode it as a different one" in finding.message


def test_family_must_match_the_config(tmp_path: Path) -> None:
    text, cfg_path = _load(tmp_path, KNOWN_MODELS["meta-llama/Meta-Llama-3-8B"].config)
    findings = _findings(text)
    assert [(f.rule, f.path) for f in findings] == [("model-config", "model.family")]
    assert f"family deepseek_v3 runs the deepseek_v3 engine but {cfg_path} has model_type 'llama'" in findings[0].message


@pytest.mark.parametrize(("body", "words"), [("{not json", "not valid JSON"), ("[1, 2]", "a config.json is a JSON object, this one is list")])
def test_broken_config_json_is_a_finding(tmp_path: Path, body: str, words: str) -> None:
    text, cfg_path = _load(tmp_path, body)
    (finding,) = _findings(text)
    assert finding.rule == "model-config" and finding.message.startswith(f"{cfg_path}: ") and words in finding.message


def test_readable_config_passes_and_feeds_the_memory_table(tmp_path: Path) -> None:
    text, cfg_path = _load(tmp_path, tiny_dsv3())
    load_topology_text(text, "t.yaml")
    topo_file = tmp_path / "t.yaml"
    topo_file.write_text(text)
    result = CliRunner().invoke(app, ["validate", str(topo_file), "--json"])
    assert result.exit_code == 0, result.output
    memory = json.loads(result.stdout)["memory"]
    assert memory["model_figures"] == str(cfg_path)
    assert [row["gpus"] for row in memory["gpus"]] == ["GPU 0", "GPU 1"] and all(row["fits"] for row in memory["gpus"])


def test_cli_exits_3_naming_the_key(tmp_path: Path) -> None:
    text, cfg_path = _load(tmp_path, {**tiny_dsv3(), "quantization_config": {"quant_method": "awq"}})
    topo_file = tmp_path / "t.yaml"
    topo_file.write_text(text)
    result = CliRunner().invoke(app, ["validate", str(topo_file)], env={"COLUMNS": "500"})
    assert result.exit_code == 3
    assert f"{topo_file}:{HF_LINE}:12: model.hf_path: {cfg_path}: quantization_config.quant_method='awq'" in result.output
