"""render_plan: the layout of docs/INTERFACES.md §5, units systemd accepts, the inventory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tilepd.plan import RenderError, build_plan, render_plan
from tilepd.plan.ansible_yaml import load_ansible_yaml
from tilepd.plan.systemd import env_file_text, quote_exec_arg
from tilepd.resources import examples_dir
from tilepd.topology import Topology, load_topology


def _with_current_python(topo: Topology) -> Topology:
    """Same topology, every service run by this interpreter (systemd-analyze verify needs an ExecStart that exists)."""
    return topo.model_copy(update={"deployment": topo.deployment.model_copy(update={"python": "current"})})


def test_layout_of_dsv32(tmp_path: Path) -> None:
    plan = build_plan(load_topology(examples_dir() / "dsv32-multiconnector.yaml"))
    out = tmp_path / "r"
    written = render_plan(plan, out)
    rel = sorted(str(p.relative_to(out)) for p in written)
    assert rel == sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert "plan.json" in rel and "inventory.yml" in rel
    assert {
        "hosts/10.0.1.10/kv-transfer-config.json",
        "hosts/10.0.1.10/env/prefill-p0.env",
        "hosts/10.0.1.10/units/tilepd-prefill-p0.service",
        "hosts/10.0.1.10/services.json",
        "hosts/10.0.1.20/config/decode-d0.json",
        "hosts/10.0.1.20/units/tilepd-convert-d0.service",
        "hosts/10.0.1.30/config/native-decode-n0.json",
        "hosts/10.0.1.40/config/router.json",
    } <= set(rel)
    assert json.loads((out / "plan.json").read_text()) == plan.model_dump(mode="json")
    assert json.loads((out / "hosts/10.0.1.20/config/decode-d0.json").read_text()) == plan.service("decode-d0").config
    unit = (out / "hosts/10.0.1.10/units/tilepd-prefill-p0.service").read_text()
    for line in ("Restart=on-failure", "EnvironmentFile=/opt/tilepd/dsv32/env/prefill-p0.env", "LimitMEMLOCK=infinity", "LimitNOFILE=1048576"):
        assert line in unit.splitlines()
    convert = (out / "hosts/10.0.1.20/units/tilepd-convert-d0.service").read_text()
    assert "Type=oneshot" in convert and "ConditionPathExists=!/models/tilepd-dsv32" in convert and "Restart=" not in convert


def test_inventory(tmp_path: Path) -> None:
    out = tmp_path / "r"
    render_plan(build_plan(load_topology(examples_dir() / "glm51-seed.yaml")), out)
    inv = load_ansible_yaml((out / "inventory.yml").read_text())["all"]
    host = inv["hosts"]["10.0.0.20"]
    assert host["ansible_connection"] == "ssh" and host["ansible_user"] == "tilepd" and host["ansible_port"] == 22
    assert host["ansible_ssh_private_key_file"] == "/home/ops/.ssh/tilepd_ed25519"
    assert host["tilepd_services"] == ["convert-d0", "decode-d0"]
    assert host["tilepd_host_dir"] == str(out / "hosts" / "10.0.0.20")
    assert set(inv["children"]) == {"prefill", "decode", "router"}
    assert inv["vars"]["tilepd_services_mode"] == "systemd"
    local = tmp_path / "l"
    render_plan(build_plan(load_topology(examples_dir() / "local.yaml")), local)
    inv = load_ansible_yaml((local / "inventory.yml").read_text())["all"]
    assert inv["hosts"]["127.0.0.1"]["ansible_connection"] == "local" and "ansible_user" not in inv["hosts"]["127.0.0.1"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("example", ["dsv32-multiconnector.yaml", "local.yaml"])
def test_units_pass_systemd_analyze_verify(tmp_path: Path, example: str) -> None:
    plan = build_plan(_with_current_python(load_topology(examples_dir() / example)))
    render_plan(plan, tmp_path / "r")
    units = sorted(str(p) for p in (tmp_path / "r").glob("hosts/*/units/*.service"))
    assert units
    proc = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "quoting" not in proc.stderr.lower()


def test_systemd_verify_catches_what_it_should(tmp_path: Path) -> None:
    """Guard for the test above: verify does reject a unit with an unbalanced quote, so its pass means something."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    bad = tmp_path / "tilepd-bad.service"
    bad.write_text(f'[Service]\nExecStart={sys.executable} "{{\\"a\\": 1}}\n')
    proc = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0


def test_quote_exec_arg() -> None:
    assert quote_exec_arg("--port") == "--port"
    assert quote_exec_arg("/a/b") == "/a/b"
    assert quote_exec_arg('{"a": "b c"}') == '"{\\"a\\": \\"b c\\"}"'
    assert quote_exec_arg("100%") == '"100%%"'
    assert quote_exec_arg("$HOME") == '"$$HOME"'
    assert quote_exec_arg("") == '""'
    assert quote_exec_arg("a\\b") == '"a\\\\b"'


def test_env_file_text() -> None:
    assert env_file_text({"A": "1", "B": 'x "y"'}) == 'A="1"\nB="x \\"y\\""\n'


def test_rerender_replaces_and_refuses_foreign_folders(tmp_path: Path) -> None:
    plan = build_plan(load_topology(examples_dir() / "local.yaml"))
    out = tmp_path / "r"
    render_plan(plan, out)
    (out / "stale.txt").write_text("old")
    render_plan(plan, out)
    assert not (out / "stale.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(RenderError, match="holds no earlier render"):
        render_plan(plan, foreign)
    assert (foreign / "keep.txt").read_text() == "mine"


def test_strings_yaml_1_1_reads_as_other_types_reach_ansible_as_strings() -> None:
    """Ansible reads host_vars with PyYAML (YAML 1.1): `yes`, `on`, `0600` or `1:20` written bare would come back as
    True, 384 or 80; an env value or argv word must arrive as the operator wrote it."""
    import yaml

    from tilepd.plan.ansible_yaml import ansible_yaml

    values = {"a": "yes", "b": "on", "c": "0600", "d": "1:20", "e": "~", "f": "plain", "g": "{{ lookup('pipe', 'id') }}", "n": 5}
    text = ansible_yaml(values, "test")

    class AnsibleLike(yaml.SafeLoader):
        pass

    AnsibleLike.add_constructor("!unsafe", lambda loader, node: loader.construct_scalar(node))
    assert yaml.load(text, Loader=AnsibleLike) == values
