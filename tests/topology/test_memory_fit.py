"""Rule memory-fit: parameter counts from config shapes, per-GPU estimates, the seed fits in fp8 and not in bf16,
and every fix the finding proposes does make the topology fit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tilepd.cli.app import app
from tilepd.model_format.model_spec import spec_from_hf_config
from tilepd.resources import examples_dir
from tilepd.topology import TopologyError, load_topology_text
from tilepd.topology.gpus import GIB, MIB, known_gpu
from tilepd.topology.known_models import KNOWN_MODELS
from tilepd.topology.memory_fit import (WORKSPACE_BYTES, checkpoint_dtype, decode_policy, fp8_bytes, layout_shapes, memory_report,
                                       parameter_count, vllm_policy, weight_bytes)

SEED = (examples_dir() / "glm51-seed.yaml").read_text()
DSV32 = (examples_dir() / "dsv32-multiconnector.yaml").read_text()
LOCAL = (examples_dir() / "local.yaml").read_text()


def _spec(hf_id: str):
    return spec_from_hf_config(KNOWN_MODELS[hf_id].config)


@pytest.mark.parametrize(
    ("hf_id", "main", "with_mtp"),
    [
        # DeepSeek-V3: "671B total parameters" (model card); with the MTP module's own layer 682.6B, and with the
        # embedding and head the checkpoint repeats for it (2 x 129280 x 7168) 684.5B (the hub's "685B" also counts
        # the fp8 block scales)
        ("deepseek-ai/DeepSeek-V3", 671_026_419_200, 682_636_487_424),
        ("deepseek-ai/DeepSeek-V3.2", 671_877_944_064, 683_501_971_712),
        # GLM-5.1: 753,864,139,008 is the sum over the bf16 checkpoint's 59,870 tensors (its MTP layer has no
        # embedding or head of its own); "744B" on the model card is the main model
        ("zai-org/GLM-5.1", 743_911_218_432, 753_864_139_008),
        ("meta-llama/Meta-Llama-3-8B", 8_030_261_248, 8_030_261_248),  # "8.03B" (HF)
        ("meta-llama/Meta-Llama-3-70B", 70_553_706_496, 70_553_706_496),  # "70.6B" (HF)
    ],
)
def test_parameter_count_from_config_shapes(hf_id: str, main: int, with_mtp: int) -> None:
    spec = _spec(hf_id)
    assert parameter_count(spec) == main
    assert parameter_count(spec, mtp=True) == with_mtp


def test_fp8_bytes_is_one_byte_plus_a_scale_per_block() -> None:
    assert fp8_bytes((128, 128)) == 128 * 128 + 4
    assert fp8_bytes((129, 256)) == 129 * 256 + 4 * 2 * 2
    assert fp8_bytes((4, 256, 128)) == 4 * 256 * 128 + 4 * 4 * 2  # per expert


def test_router_gate_counts_the_checkpoints_dtype() -> None:
    """GLM-5.1's router gate [256, 6144] is bf16 in its checkpoint and stays so (convert-weights, out_tensors source_float):
    3 MiB a MoE layer on every TP rank (replicated), not the 6 MiB of a widened float32 copy; an fp32 source or an fp32
    conversion stores it float32. vLLM holds it in the model dtype (GateLinear)."""
    spec = _spec("zai-org/GLM-5.1")
    assert {checkpoint_dtype(m.config) for m in KNOWN_MODELS.values()} == {"bfloat16"}  # `dtype` or `torch_dtype`
    assert checkpoint_dtype({"dtype": "float32"}) == checkpoint_dtype({}) == "float32"  # unstated: never under-counted
    gates = [(t, shape) for t, shape in layout_shapes(spec) if t.name.endswith(".gate")]
    assert len(gates) == 75 + 1 and all(t.source_float and not t.keep_fp32 and shape == (256, 6144) for t, shape in gates)  # 75 MoE + MTP
    t, shape = gates[0]
    one = 256 * 6144 * 2
    assert decode_policy("fp8", "bfloat16")(t, shape) == decode_policy("bf16", "bfloat16")(t, shape) == one == 3_145_728
    assert decode_policy("fp8", "float32")(t, shape) == decode_policy("fp32", "bfloat16")(t, shape) == 2 * one
    assert vllm_policy(True, False)(t, shape) == one
    for tp in (1, 8):
        main, mtp = weight_bytes(spec, tp, decode_policy("fp8", "bfloat16"))
        main_wide, mtp_wide = weight_bytes(spec, tp, decode_policy("fp8", "float32"))
        assert (main_wide - main, mtp_wide - mtp) == (75 * one, one), tp


def _llama8b_on_one(gpu: str, extra: str = "") -> str:
    # the example's base_dir is the user's own (~/.local/state/tilepd/local): after the README's demo it holds the tiny
    # generated model, whose config.json the report would read instead of Llama-3-8B's; a base that never exists here
    absent = f"{tempfile.gettempdir()}/tilepd-memory-fit-{uuid.uuid4().hex}"
    text = LOCAL.replace("~/.local/state/tilepd/local", absent)
    text = text.replace("  generate_tiny: llama\n", "  hf_id: meta-llama/Meta-Llama-3-8B\n").replace("  max_seq_len: 2048\n", "  max_seq_len: 8192\n")
    return text.replace("    gpu: {type: cpu}\n", f"    gpu: {{type: {gpu}, count: 1}}\n{extra}")


def test_llama3_8b_on_one_h100_by_hand() -> None:
    text = _llama8b_on_one("H100")
    assert "hf_id" in text and "type: H100" in text
    (row,) = memory_report(load_topology_text(text, "l.yaml")).rows
    n, layers, kv_heads, hd = 8192, 32, 8, 128
    assert row.parts["weights"] == 8_030_261_248 * 2  # bf16, every tensor of Llama is 2 bytes
    assert row.parts["kv_cache"] == layers * n * 2 * hd * kv_heads * 2  # K and V, bf16: 1 GiB
    assert row.parts["recv_buffer"] == layers * (n + 256) * kv_heads * 2 * hd * 2  # the wire in bf16 ("auto" on a GPU)
    assert row.parts["workspace"] == WORKSPACE_BYTES + n * hd * 2 * 2  # + the RoPE table
    assert row.parts["mtp"] == row.parts["indexer_cache"] == 0
    assert row.capacity == 81559 * MIB and row.fits


def test_unknown_gpu_is_stated_by_memory_gib() -> None:
    with pytest.raises(TopologyError, match="GPU type 'RTX-9090' is not in tilepd's table"):
        load_topology_text(_llama8b_on_one("RTX-9090"), "l.yaml")
    text = _llama8b_on_one("RTX-9090").replace("count: 1}", "count: 1, memory_gib: 32}")
    (row,) = memory_report(load_topology_text(text, "l.yaml")).rows
    assert row.capacity == 32 * GIB and row.fits
    # a stated size wins over the table, and a 16 GiB card does not hold 8B in bf16
    with pytest.raises(TopologyError, match=r"more than the 16.0 GiB of one H100 \(16 GiB as stated\)"):
        load_topology_text(_llama8b_on_one("H100").replace("count: 1}", "count: 1, memory_gib: 16}"), "l.yaml")


def test_gpu_names_are_normalised() -> None:
    assert known_gpu("NVIDIA H100 80GB HBM3") is known_gpu("h100") is known_gpu("H100_SXM")
    assert known_gpu("A100") is None  # 40 or 80 GB: ambiguous, to be stated
    assert known_gpu("NVIDIA B200").memory_bytes == 183359 * MIB


def test_seed_fits_in_fp8_with_these_figures() -> None:
    report = memory_report(load_topology_text(SEED, "seed.yaml"))
    assert report.source and report.source.startswith("bundled figures of zai-org/GLM-5.1-FP8")
    gpu0, rest, prefill = report.rows
    n, layers, mtp = 202752, 78, 1
    assert gpu0.parts["kv_cache"] == layers * n * 576 * 2  # MLA latent (512 + 64) in bf16, replicated on every rank
    assert gpu0.parts["indexer_cache"] == layers * n * 128 * 2  # every GLM-5.1 layer keeps indexer keys (index_head_dim 128)
    assert gpu0.parts["recv_buffer"] == (n + 256) * (layers + mtp) * (576 + 132)  # fp8 wire + vLLM's 132-byte indexer keys
    assert rest.parts["recv_buffer"] == 0 and rest.parts["weights"] == gpu0.parts["weights"]
    assert 85 * GIB < gpu0.parts["weights"] < 95 * GIB  # ~744B parameters / 8, mostly fp8
    assert prefill.gpus == "each of 8 GPUs" and prefill.capacity == int(183359 * MIB * 0.8)
    assert prefill.parts["kv_cache"] == layers * n * 656  # fp8_ds_mla
    assert all(r.fits for r in report.rows)


def _messages(text: str) -> list[str]:
    with pytest.raises(TopologyError) as info:
        load_topology_text(text, "t.yaml")
    return [f.message for f in info.value.findings if f.rule == "memory-fit"]


def test_seed_in_bf16_fails_with_numbers_and_fixes_that_work() -> None:
    bf16 = SEED.replace("  weights_dtype: fp8\n", "  weights_dtype: bf16\n")
    (message,) = _messages(bf16)
    assert re.search(r"d0 needs 2\d\d\.\d GiB on GPU 0, more than the 179\.1 GiB of one B200 .*: weights 17\d\.\d GiB", message)
    assert "(bf16 weights, TP 8, 202752 tokens)" in message
    assert "model.weights_dtype: fp8 (123.8 GiB per GPU)" in message  # router gates bf16 as in the checkpoint (124.0 when widened)
    assert "model.tensor_parallel.decode: 16 on nodes of 16 GPUs" in message
    # the proposed TP does fit, on a node that has the GPUs
    load_topology_text(bf16.replace("    decode: 8\n", "    decode: 16\n").replace("{type: B200, count: 8}", "{type: B200, count: 16}"), "t.yaml")


def test_max_seq_len_fix_is_the_longest_that_fits() -> None:
    bf16 = DSV32.replace("  weights_dtype: fp8", "  weights_dtype: bf16")
    messages = _messages(bf16)
    assert len(messages) == 2  # both decode nodes
    n = int(re.search(r"model\.max_seq_len: (\d+) or less", messages[0]).group(1))
    assert 100_000 < n < 163840
    load_topology_text(bf16.replace("  max_seq_len: 163840\n", f"  max_seq_len: {n}\n"), "t.yaml")
    assert _messages(bf16.replace("  max_seq_len: 163840\n", f"  max_seq_len: {n + 1}\n"))
    assert "decode[0].recv_buffer: dram" in messages[0]


def test_cli_bf16_copy_exits_3_with_the_numbers(tmp_path: Path) -> None:
    path = tmp_path / "glm51-seed-bf16.yaml"
    path.write_text(SEED.replace("  weights_dtype: fp8\n", "  weights_dtype: bf16\n"))
    result = CliRunner().invoke(app, ["validate", str(path), "--json"])
    assert result.exit_code == 3
    (finding,) = json.loads(result.stdout)["findings"]
    assert finding["rule"] == "memory-fit" and finding["path"] == "decode[0].gpu"
    assert "model.weights_dtype: fp8" in finding["message"]


def test_no_figures_says_so() -> None:
    report = memory_report(load_topology_text(DSV32.replace("  hf_id: deepseek-ai/DeepSeek-V3.2\n", ""), "t.yaml"))
    assert report.rows == [] and "no config.json at /models/DeepSeek-V3.2 on this machine" in (report.not_checked or "")


def test_validate_does_not_import_torch(tmp_path: Path) -> None:
    bf16 = tmp_path / "bf16.yaml"
    bf16.write_text(SEED.replace("  weights_dtype: fp8\n", "  weights_dtype: bf16\n"))
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from tilepd.cli.app import app\n"
        f"assert CliRunner().invoke(app, ['validate', {str(examples_dir() / 'glm51-seed.yaml')!r}]).exit_code == 0\n"
        f"assert CliRunner().invoke(app, ['validate', {str(bf16)!r}]).exit_code == 3\n"
        "assert 'torch' not in sys.modules, 'validate imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("value", [".inf", "1e308", ".nan", "0"])
def test_stated_memory_must_be_a_real_size(value: str) -> None:
    with pytest.raises(TopologyError) as info:
        load_topology_text(SEED.replace("{type: B200, count: 8}", f"{{type: B200, count: 8, memory_gib: {value}}}"), "t.yaml")
    (finding,) = info.value.findings
    assert (finding.rule, finding.path) == ("schema.invalid", "decode[0].gpu.memory_gib")
