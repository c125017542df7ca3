"""`tilepd down --purge-weights` deletes only the converted weights: never hf_path (equal, inside or around it)
nor a base_dir, checked on the topology before anything runs and again on the host after resolving symlinks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy import topo
from tests.deploy.cli import tilepd
from tilepd.deploy.weights import purge_refusal


@pytest.mark.parametrize(("weights", "hf", "base", "why"), [
    ("/m/llama", "/m/llama", "/opt/t", "equals hf_path /m/llama"),
    ("/m", "/m/llama", "/opt/t", "contains hf_path /m/llama"),
    ("/m/llama/tilepd", "/m/llama", "/opt/t", "lies inside hf_path /m/llama"),
    ("/m/llama/", "/m/llama/../llama", "/opt/t", "equals hf_path"),
    ("/opt", "/m/llama", "/opt/t", "contains base_dir /opt/t"),
    ("/opt/t", "/m/llama", "/opt/t", "equals base_dir /opt/t"),
    ("/", "/m/llama", "/opt/t", "is the filesystem root"),
])  # fmt: skip
def test_purge_refusal_names_both_paths(weights: str, hf: str, base: str, why: str) -> None:
    msg = purge_refusal(weights, hf, [base])
    assert msg is not None and why in msg and f"weights_path {weights}" in msg


@pytest.mark.parametrize(("weights", "hf"), [("/m/llama-tilepd", "/m/llama"), ("/m/llama2", "/m/llama"), ("/opt/t/weights", "/m/llama")])
def test_a_sibling_or_a_folder_under_base_dir_may_be_purged(weights: str, hf: str) -> None:
    assert purge_refusal(weights, hf, ["/opt/t"]) is None


def _local(tmp_path: Path, weights: Path) -> tuple[dict, Path]:
    data = topo.local_topology(tmp_path, name="t-purge")
    data["model"]["weights_path"] = str(weights)
    hf = Path(data["model"]["hf_path"])
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    return data, topo.write(data, tmp_path / "topology.yaml")


def test_down_refuses_a_weights_path_around_hf_path_before_anything_runs(tmp_path: Path) -> None:
    data, file = _local(tmp_path, tmp_path / "models")  # the folder that holds hf_path
    r = tilepd(tmp_path / "home", "down", str(file), "--purge-weights")
    assert r.rc == 3, r
    assert f"weights_path {tmp_path / 'models'} contains hf_path {data['model']['hf_path']}" in r.stderr, r
    assert (Path(data["model"]["hf_path"]) / "config.json").exists()


@pytest.mark.slow
def test_the_host_resolves_symlinks_before_it_purges(tmp_path: Path) -> None:
    """weights_path is a symlink to hf_path (the strings differ, the host's folders do not): the playbook's purge task
    fails naming both and deletes nothing; a real weights folder is deleted by the same task."""
    link = tmp_path / "weights-link"
    data, file = _local(tmp_path, link)
    link.symlink_to(data["model"]["hf_path"])
    refused = tilepd(tmp_path / "home", "down", str(file), "--purge-weights")
    assert refused.rc == 6, refused
    assert "refusing to purge" in refused.out and f"hf_path {data['model']['hf_path']}" in refused.out, refused
    assert (Path(data["model"]["hf_path"]) / "config.json").exists()

    weights = tmp_path / "models" / "tiny-llama-tilepd"
    (weights / "rank0").mkdir(parents=True)
    (weights / "rank0" / "w.bin").write_bytes(b"0" * 16)
    data["model"]["weights_path"] = str(weights)
    topo.write(data, file)
    purged = tilepd(tmp_path / "home", "down", str(file), "--purge-weights")
    assert purged.rc == 0, purged
    assert not weights.exists() and (Path(data["model"]["hf_path"]) / "config.json").exists()
