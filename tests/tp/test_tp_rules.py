"""validate-time mapping between prefill TP and decode TP (rule tp-heads) on real configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tilepd.topology import TopologyError, load_topology

BASE = Path(__file__).resolve().parents[1] / "topology" / "base_valid.yaml"


def _topology(tmp_path: Path, hf_path: Path, family: str, prefill: int, decode: int) -> Path:
    doc = yaml.safe_load(BASE.read_text())
    m = doc["model"]
    m.update(family=family, hf_path=str(hf_path), tensor_parallel={"prefill": prefill, "decode": decode})
    if family == "llama":
        m.pop("kv_cache_dtype"), m.pop("speculative")
    doc["prefill"][0]["gpus"] = prefill
    doc["decode"][0]["gpu"]["count"] = decode
    doc["native_decode"][0]["gpus"] = 8
    out = tmp_path / "topology.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def _config(tmp_path: Path, family: str = "llama", **cfg: int) -> Path:
    """A whole config.json (rule model-config refuses a partial one) of the family, with the given head counts."""
    from tilepd.topology.known_models import KNOWN_MODELS

    base = KNOWN_MODELS["meta-llama/Meta-Llama-3-8B" if family == "llama" else "deepseek-ai/DeepSeek-V3"].config
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**base, **cfg}))
    return d


@pytest.mark.parametrize("prefill,decode", [(1, 8), (8, 1), (2, 4), (4, 8)])
def test_attention_heads_that_split_on_both_sides_pass(tmp_path: Path, prefill: int, decode: int) -> None:
    hf = _config(tmp_path, num_attention_heads=64, num_key_value_heads=8)
    load_topology(_topology(tmp_path, hf, "llama", prefill, decode))


@pytest.mark.parametrize("role,prefill,decode", [("prefill", 16, 1), ("decode", 1, 16)])
def test_kv_heads_that_do_not_split_are_refused_naming_the_fields(tmp_path: Path, role: str, prefill: int, decode: int) -> None:
    hf = _config(tmp_path, num_attention_heads=64, num_key_value_heads=8)
    with pytest.raises(TopologyError) as info:
        load_topology(_topology(tmp_path, hf, "llama", prefill, decode))
    [f] = [f for f in info.value.findings if f.rule == "tp-heads"]
    assert f"model.tensor_parallel.{role}=16 does not divide num_key_value_heads=8 of {hf / 'config.json'}" in f.message


def test_mla_latent_maps_any_prefill_tp(tmp_path: Path) -> None:
    """MLA: prefill rank 0 sends the one latent whatever the prefill TP; decode TP must split the heads."""
    hf = _config(tmp_path, "deepseek_v3", num_attention_heads=128, num_key_value_heads=128)
    load_topology(_topology(tmp_path, hf, "deepseek_v3", 8, 8))
    hf = _config(tmp_path, "deepseek_v3", num_attention_heads=12, num_key_value_heads=12)
    with pytest.raises(TopologyError, match="tensor_parallel.decode=8 does not divide num_attention_heads=12"):
        load_topology(_topology(tmp_path, hf, "deepseek_v3", 1, 8))


def test_unreadable_config_is_left_to_the_node(tmp_path: Path) -> None:
    """No config.json on the validating machine: nothing to check here (the decode node refuses at start)."""
    load_topology(_topology(tmp_path, tmp_path / "absent", "llama", 16, 16))
