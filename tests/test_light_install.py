"""An operator's laptop: the wheel without extras (no torch, no vLLM) validates, plans and renders every bundled example.

The fresh venv holds only the wheel's own dependencies (from the package index, as `pip install
tilepd-*.whl` would fetch them; CI reaches the index). It is cached under ~/.cache/tilepd/, keyed
by the interpreter and the wheel's dependency list, so a repeat run only reinstalls the wheel.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tilepd"
EXAMPLES = sorted(p.name for p in (REPO / "topology_examples").glob("*.yaml"))

pytestmark = pytest.mark.slow


def _base_requirements(wheel: Path) -> list[str]:
    """Requires-Dist of the wheel, without the extras' entries."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    reqs = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    return sorted(r for r in reqs if "extra ==" not in r)


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH (the checkout must not leak in), no venv of the test run on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p and "venv-py" not in p)
    return env


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(REPO)], check=True)
    (wheel,) = dist.glob("tilepd-*.whl")
    reqs = _base_requirements(wheel)
    assert reqs and not any(r.split()[0].lower().startswith(("torch", "vllm")) for r in reqs), reqs
    key = hashlib.sha256("\n".join([sys.version.split()[0], *reqs]).encode()).hexdigest()[:16]
    venv = CACHE / f"light-venv-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    env = _clean_env()
    with open(CACHE / f"light-venv-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once share one venv
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *reqs], check=True, env=env)
            (venv / ".complete").write_text("\n".join(reqs) + "\n")
        # the wheel under test, with exactly the dependencies above (no extras, nothing else)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
                       check=True, env=env)
        yield venv


def test_no_heavy_package_in_the_light_venv(light_venv: Path) -> None:
    code = "import importlib.util as u; print([m for m in ('torch', 'vllm', 'triton') if u.find_spec(m)])"
    out = subprocess.run([str(light_venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True, env=_clean_env())
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("example", EXAMPLES)
def test_bundled_example_validates_plans_and_renders(light_venv: Path, example: str, tmp_path: Path) -> None:
    tilepd = str(light_venv / "bin" / "tilepd")
    # the installed package's own copy of the example, as an operator would use it
    where = subprocess.run([str(light_venv / "bin" / "python"), "-c", "from tilepd.resources import examples_dir; print(examples_dir())"],
                           capture_output=True, text=True, check=True, env=_clean_env(), cwd=tmp_path).stdout.strip()
    assert Path(where).is_relative_to(light_venv), where
    topo = str(Path(where) / example)
    for argv in (["validate", topo], ["plan", topo], ["render", topo, "--out", str(tmp_path / "out")]):
        r = subprocess.run([tilepd, *argv], capture_output=True, text=True, env=_clean_env(), cwd=tmp_path)
        assert r.returncode == 0, f"tilepd {' '.join(argv)} -> {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        assert "torch" not in r.stderr, r.stderr
    assert any((tmp_path / "out").rglob("*.json")), "render wrote no service config"


def test_capacity_runs_in_the_light_install(light_venv: Path, tmp_path: Path) -> None:
    r = subprocess.run([str(light_venv / "bin" / "tilepd"), "capacity", "--rps", "2", "--output-tokens", "100", "--ms-per-token", "5",
                        "--prefill-ms", "50", "--sim-requests", "5000", "--json"], capture_output=True, text=True, env=_clean_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"nodes_needed"' in r.stdout
