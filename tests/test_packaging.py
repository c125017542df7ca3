"""What ships to machines must work from an installed wheel, not only from a checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(REPO)], check=True)
    (wheel,) = dist.glob("tilepd-*.whl")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def _run_from(site: Path, code: str) -> str:
    # -I: isolated mode, so the checkout (cwd, editable install's path hooks) cannot leak in.
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
                         check=True, capture_output=True, text=True, cwd=site)
    return out.stdout.strip()


def test_wheel_carries_playbooks_and_examples(unpacked_wheel: Path) -> None:
    playbooks = _run_from(unpacked_wheel, "from tilepd.resources import playbooks_dir; print(playbooks_dir())")
    examples = _run_from(unpacked_wheel, "from tilepd.resources import examples_dir; print(examples_dir())")
    assert Path(playbooks).is_relative_to(unpacked_wheel), playbooks
    assert Path(examples).is_relative_to(unpacked_wheel), examples
    for name in ("up.yml", "down.yml", "ansible.cfg"):
        assert (Path(playbooks) / name).is_file()
    shipped = {p.name for p in Path(examples).glob("*.yaml")}
    assert shipped == {p.name for p in (REPO / "topology_examples").glob("*.yaml")}


def test_wheel_playbooks_use_their_ansible_cfg(unpacked_wheel: Path, tmp_path: Path) -> None:
    """The runner points ANSIBLE_CONFIG at playbooks_dir()/ansible.cfg: from a wheel, its relative paths are the wheel's."""
    playbooks = Path(_run_from(unpacked_wheel, "from tilepd.resources import playbooks_dir; print(playbooks_dir())"))
    cfg = playbooks / "ansible.cfg"
    out = subprocess.run([str(Path(sys.executable).parent / "ansible-config"), "dump", "--only-changed"], cwd=tmp_path,
                         env={**os.environ, "ANSIBLE_CONFIG": str(cfg)}, check=True, capture_output=True, text=True, timeout=120)
    assert f"DEFAULT_ROLES_PATH({cfg}) = ['{playbooks / 'roles'}']" in out.stdout, out.stdout
    assert f"DEFAULT_LOOKUP_PLUGIN_PATH({cfg}) = ['{playbooks / 'lookup_plugins'}']" in out.stdout, out.stdout


def test_installed_package_validates_its_embedded_default(unpacked_wheel: Path) -> None:
    code = (
        "from tilepd.resources import examples_dir; from tilepd.topology import load_topology; "
        "t = load_topology(examples_dir() / 'local.yaml'); print(t.deployment.name)"
    )
    assert _run_from(unpacked_wheel, code) == "local"
