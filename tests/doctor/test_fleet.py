"""Doctor checks across hosts: one checkpoint everywhere (`checkpoint-identity`), one vLLM release in the prefill and
native decode pools (`vllm-release`). The evaluation is pure; the gathering runs for real on this host."""

from __future__ import annotations

import json
from pathlib import Path

from tests.deploy import topo as topo_files
from tilepd.contracts.fingerprint import checkpoint_identity
from tilepd.deploy.remote import HostShell
from tilepd.dev.tiny_model import make_tiny_model
from tilepd.doctor.checks_fleet import HostFacts, evaluate_checkpoint_identity, evaluate_vllm_release, gather
from tilepd.doctor.expect import host_expectations
from tilepd.doctor.probe import Probe
from tilepd.plan import build_plan
from tilepd.topology import load_topology
from tilepd.weights.convert import convert_weights
from tilepd.weights.manifest import MANIFEST

A = {"id": "aaaa", "weights": "w1", "index": None, "config": "c1", "tokenizer": "t1"}
B = {**A, "id": "bbbb", "weights": "w2"}


def test_one_checkpoint_everywhere_passes_and_another_fails_naming_both() -> None:
    same = [HostFacts("p0", ["prefill"], checkpoint=A), HostFacts("d0", ["decode"], checkpoint=A, weights_source=A)]
    assert [f.verdict for f in evaluate_checkpoint_identity(same)] == ["ok", "ok", "ok"]
    drifted = [HostFacts("d0", ["decode"], checkpoint=A, weights_source=B), HostFacts("p0", ["prefill"], checkpoint=A),
               HostFacts("n0", ["native_decode"], checkpoint={**A, "id": "cccc", "config": "c2"})]
    found = {(f.host, f.verdict): f for f in evaluate_checkpoint_identity(drifted)}
    bad = found[("d0", "fail")]
    assert "converted weights' source bbbb differs from the checkpoint aaaa on p0 in weights" in bad.evidence
    assert bad.runbook == "RB-fingerprint-mismatch" and bad.required
    assert "in config" in found[("n0", "fail")].evidence and ("p0", "ok") in found
    unknown = evaluate_checkpoint_identity([HostFacts("d0", ["decode"], weights_source={"error": "its manifest records no source identity"})])
    assert unknown[0].verdict == "warn" and not unknown[0].required


def test_the_pools_must_run_one_vllm_release_when_there_is_a_native_pool() -> None:
    one = [HostFacts("p0", ["prefill"], vllm={"prefill": "0.32.0"}), HostFacts("n0", ["native_decode"], vllm={"native_decode": "0.32.0"})]
    assert [f.verdict for f in evaluate_vllm_release(one, native_pool=True)] == ["ok", "ok"]
    mixed = [HostFacts("p0", ["prefill"], vllm={"prefill": "0.32.0"}), HostFacts("n0", ["native_decode"], vllm={"native_decode": "0.33.0"})]
    found = evaluate_vllm_release(mixed, native_pool=True)
    assert all(f.verdict == "fail" and f.required for f in found)
    assert "p0 (prefill) 0.32.0, n0 (native_decode) 0.33.0" in found[0].evidence and found[0].runbook == "RB-upgrade"
    assert evaluate_vllm_release(mixed, native_pool=False) == []


def test_a_host_reports_its_checkpoint_and_its_weights_source(tmp_path: Path) -> None:
    data = topo_files.local_topology(tmp_path)
    del data["model"]["generate_tiny"]
    topo = load_topology(topo_files.write(data, tmp_path / "local.yaml"))
    hf = make_tiny_model("llama", Path(topo.model.hf_path))
    convert_weights(hf, Path(topo.model.weights_path), dtype="fp32", progress=False)
    (exp,) = host_expectations(topo, build_plan(topo))
    shell = HostShell(exp.host)
    try:
        facts = gather(Probe(shell), exp, topo)
        want = checkpoint_identity(hf).id
        assert facts.checkpoint is not None and facts.checkpoint["id"] == want
        assert facts.weights_source is not None and facts.weights_source["id"] == want
        assert [f.verdict for f in evaluate_checkpoint_identity([facts])] == ["ok", "ok"]
        # the weights were converted from another checkpoint of the same shapes
        other = make_tiny_model("llama", tmp_path / "other", seed=1)
        manifest = json.loads((Path(topo.model.weights_path) / MANIFEST).read_text())
        manifest["source_identity"] = checkpoint_identity(other).model_dump()
        (Path(topo.model.weights_path) / MANIFEST).write_text(json.dumps(manifest))
        found = evaluate_checkpoint_identity([gather(Probe(shell), exp, topo)])
        assert [f.verdict for f in found] == ["ok", "fail"] and checkpoint_identity(other).id in found[1].evidence
    finally:
        shell.close()
