"""Loader behaviour beyond single rules: YAML errors, positions, several findings at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilepd.topology import TopologyError, TopologyFileError, load_topology, load_topology_text

BASE = (Path(__file__).parent / "base_valid.yaml").read_text()


def test_yaml_error_carries_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: tilepd/v1\ndeployment:\n  name: [x\n  base_dir: /x\n")
    with pytest.raises(TopologyFileError) as info:
        load_topology(bad)
    assert info.value.line == 4
    assert str(info.value).startswith(f"{bad}:4:")
    assert "not valid YAML" in str(info.value)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(TopologyFileError, match="no such file"):
        load_topology(tmp_path / "absent.yaml")
    with pytest.raises(TopologyFileError, match="is a directory"):
        load_topology(tmp_path)


def test_duplicate_yaml_key_is_a_file_error() -> None:
    with pytest.raises(TopologyFileError) as info:
        load_topology_text(BASE.replace("  services: process\n", "  services: process\n  services: systemd\n"), "dup.yaml")
    assert info.value.line == 6


def test_all_findings_reported_together() -> None:
    text = BASE.replace("  hf_path: /models/tiny\n", "  hf_path: relative\n").replace("  name: nixl\n", "  name: tcp\n")
    with pytest.raises(TopologyError) as info:
        load_topology_text(text, "t.yaml")
    assert {f.rule for f in info.value.findings} == {"absolute-path", "native-pool-transport"}
    # sorted by position
    assert [f.line for f in info.value.findings] == sorted(f.line for f in info.value.findings)


def test_unknown_key_without_close_match_lists_allowed_keys() -> None:
    with pytest.raises(TopologyError) as info:
        load_topology_text(BASE.replace("  name: nixl\n", "  name: nixl\n  zzz: 1\n"), "t.yaml")
    (finding,) = info.value.findings
    assert finding.path == "transport.zzz"
    assert "allowed: mooncake_protocol, name, ucx_net_devices" in finding.message


def test_wrong_api_version_says_what_is_read() -> None:
    with pytest.raises(TopologyError) as info:
        load_topology_text(BASE.replace("apiVersion: tilepd/v1", "apiVersion: tilepd/v2"), "t.yaml")
    (finding,) = info.value.findings
    assert (finding.line, finding.path) == (1, "apiVersion")
    assert "tilepd/v1 only" in finding.message


def test_not_a_mapping() -> None:
    with pytest.raises(TopologyError, match="YAML mapping"):
        load_topology_text("- a\n- b\n", "t.yaml")
