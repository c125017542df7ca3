"""`convert_on_nodes` (the deploy side of `tilepd convert-weights TOPOLOGY`): the weights
role on the decode nodes, through ansible, skipped when the manifest matches."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from tests.deploy import topo
from tilepd.deploy.convert_on_nodes import convert_on_nodes

pytestmark = pytest.mark.slow


def test_convert_on_nodes_converts_once_then_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILEPD_HOME", str(tmp_path / "home"))
    data = topo.local_topology(tmp_path, name="t-convert")
    file = topo.write(data, tmp_path / "topology.yaml")
    weights = Path(data["model"]["weights_path"])
    console = Console(record=True, width=200)
    assert convert_on_nodes(file, console=console) == 0
    assert (weights / "rank0.safetensors").is_file()
    stamp = (weights / "rank0.safetensors").stat().st_mtime_ns
    console = Console(record=True, width=200)
    assert convert_on_nodes(file, check=True, console=console) == 0
    assert convert_on_nodes(file, console=console) == 0
    assert (weights / "rank0.safetensors").stat().st_mtime_ns == stamp  # the manifest matched: not rewritten
    changed_lines = [line for line in console.export_text().splitlines() if " changed " in line and "Convert weights to" in line]
    assert changed_lines == []  # neither --check nor the second run reported the conversion as a change


def test_convert_on_nodes_reports_a_bad_topology(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: tilepd/v1\n")
    assert convert_on_nodes(bad, console=Console(record=True)) == 3
    assert convert_on_nodes(tmp_path / "missing.yaml", console=Console(record=True)) == 4
