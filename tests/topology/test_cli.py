"""`tilepd validate | plan | render` through typer's CliRunner, and one real `tilepd validate` process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tilepd.cli.app import app
from tilepd.contracts.exit_codes import ExitCode
from tilepd.resources import examples_dir

FIXTURES = Path(__file__).parent / "fixtures"
GLM = str(examples_dir() / "glm51-seed.yaml")


@pytest.fixture()
def runner() -> CliRunner:
    return CliRunner()


def test_validate_ok(runner: CliRunner) -> None:
    result = runner.invoke(app, ["validate", GLM], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "valid (glm51-seed" in result.output
    assert "GPU memory, per GPU (model figures: bundled figures of zai-org/GLM-5.1-FP8" in result.output
    assert "GPU 0: fp8 weights, TP 8, 202752 tokens" in result.output and "179.1 GiB B200" in result.output


def test_validate_invalid_prints_file_line_col_and_exits_3(runner: CliRunner) -> None:
    path = FIXTURES / "schema__unknown-key.yaml"
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == ExitCode.INVALID == 3
    assert f"{path}:30:5: decode[0].ctrl_prot: unknown key 'ctrl_prot'; did you mean 'ctrl_port'?" in result.output


def test_validate_json(runner: CliRunner) -> None:
    result = runner.invoke(app, ["validate", str(FIXTURES / "port-collision__decode.yaml"), "--json"])
    assert result.exit_code == 3
    doc = json.loads(result.stdout)
    assert doc["valid"] is False and doc["exit_code"] == 3
    (finding,) = doc["findings"]
    assert finding["rule"] == "port-collision" and finding["line"] == 31 and finding["path"] == "decode[0].http_port"
    ok = json.loads(runner.invoke(app, ["validate", GLM, "--json"]).stdout)
    memory = ok.pop("memory")
    assert ok == {"file": GLM, "valid": True, "exit_code": 0, "findings": []}
    assert memory["model_figures"].startswith("bundled figures of zai-org/GLM-5.1-FP8")
    assert [(g["path"], g["gpus"], g["fits"]) for g in memory["gpus"]] == [
        ("decode[0]", "GPU 0", True), ("decode[0]", "GPUs 1-7", True), ("prefill[0]", "each of 8 GPUs", True)]
    assert all(g["total_bytes"] == sum(g["bytes"].values()) < g["capacity_bytes"] for g in memory["gpus"])


def test_unreadable_or_not_yaml_exits_4_with_the_line(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(tmp_path / "absent.yaml")])
    assert result.exit_code == ExitCode.INPUT == 4
    assert "no such file" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: tilepd/v1\nmodel: {a: 1\n")
    result = runner.invoke(app, ["validate", str(bad), "--json"])
    assert result.exit_code == 4
    (finding,) = json.loads(result.stdout)["findings"]
    assert finding["line"] == 3 and "not valid YAML" in finding["message"]


def test_plan_json_is_the_complete_plan(runner: CliRunner) -> None:
    result = runner.invoke(app, ["plan", GLM, "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert list(doc) == ["api_version", "deployment", "topology_hash", "tilepd_version", "services_mode", "service_user", "base_dir", "transport",
                         "rdma", "hosts", "balancer"]
    services = [s["name"] for h in doc["hosts"] for s in h["services"]]
    assert services == ["prefill-p0", "convert-d0", "decode-d0", "router"]


def test_plan_table_for_people(runner: CliRunner) -> None:
    result = runner.invoke(app, ["plan", str(examples_dir() / "dsv32-multiconnector.yaml")], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for word in ("10.0.1.10", "prefill-p0", "native-decode-n1", "nixl_side_channel 5600", "--kv-transfer-config <json"):
        assert word in result.output
    assert runner.invoke(app, ["plan", str(FIXTURES / "mtp.yaml")]).exit_code == 3


def test_render(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["render", GLM, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "hosts/10.0.0.10/kv-transfer-config.json").is_file()
    assert runner.invoke(app, ["render", str(FIXTURES / "mtp.yaml"), "--out", str(tmp_path / "x")]).exit_code == 3
    assert not (tmp_path / "x").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("")
    assert runner.invoke(app, ["render", GLM, "--out", str(tmp_path / "busy")]).exit_code == ExitCode.USAGE


def test_real_process_validate() -> None:
    exe = Path(sys.executable).parent / "tilepd"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tilepd"]
    path = FIXTURES / "max-seq-len.yaml"
    proc = subprocess.run([*cmd, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert f"{path}:32:18: decode[0].max_seq_len: d0 holds 2048 tokens" in proc.stderr
    proc = subprocess.run([*cmd, "validate", GLM], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("example", sorted(p.name for p in examples_dir().glob("*.yaml")))
def test_validate_passes_every_example(runner: CliRunner, example: str) -> None:
    result = runner.invoke(app, ["validate", str(examples_dir() / example), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["valid"] is True
