"""Doctor checks run for real on this machine (a local host: 127.0.0.1, no SSH): ports, disk,
memlock, interpreter and versions, clock, converted-weights manifest, API key, and the CLI."""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy import topo as topo_files
from tests.deploy.cli import tilepd
from tilepd import __version__
from tilepd.deploy.remote import HostShell
from tilepd.doctor import checks_host as H
from tilepd.doctor.checks_hw import evaluate_memlock
from tilepd.doctor.expect import HostExpect, host_expectations
from tilepd.doctor.probe import Probe
from tilepd.doctor.result import ExitCode, exit_code
from tilepd.plan import Plan, build_plan
from tilepd.plan.model import PythonEnv
from tilepd.topology import Topology, load_topology
from tilepd.weights.manifest import CONVERTER_VERSION, FORMAT, write_manifest_atomically


@dataclass
class Local:
    file: Path
    topo: Topology
    plan: Plan
    exp: HostExpect
    probe: Probe


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Local]:
    data = topo_files.local_topology(tmp_path)
    data["router"]["api_key"] = {"env": "TILEPD_DOCTOR_TEST_KEY"}
    file = topo_files.write(data, tmp_path / "local.yaml")
    topo = load_topology(file)
    plan = build_plan(topo)
    (exp,) = host_expectations(topo, plan)
    shell = HostShell(exp.host)
    try:
        yield Local(file, topo, plan, exp, Probe(shell))
    finally:
        shell.close()


def test_ports_free_then_taken_by_a_real_socket(local: Local) -> None:
    found = H.run_ports(local.probe, local.exp, {})
    assert found and all(f.verdict == "ok" and f.evidence.endswith("free") for f in found)
    port = local.topo.router.port
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        by_port = {f.evidence.split()[0]: f for f in H.run_ports(local.probe, local.exp, {})}
        taken = by_port[str(port)]
        assert taken.verdict == "fail" and taken.required and taken.runbook == "RB-orphaned-ports"
        assert f"127.0.0.1:{port}" in taken.evidence and f"pid {os.getpid()}" in taken.evidence
        assert all(f.verdict == "ok" for p, f in by_port.items() if p != str(port))
        # the same listener, when it is this deployment's running router: not a conflict
        mine = H.run_ports(local.probe, local.exp, {"router": {"running": True, "pid": os.getpid()}})
        assert {f.verdict for f in mine} == {"ok"}
        assert any(f"held by this deployment's running router (pid {os.getpid()})" in f.evidence for f in mine)


def test_disk_space_against_statvfs(local: Local) -> None:
    (f,) = H.run_disk(local.probe, local.exp, local.topo, manifest_present=False)
    st = os.statvfs("/tmp")
    avail_gib = st.f_bavail * st.f_frsize / 2**30
    seen = float(f.evidence.split(" GiB free")[0])
    assert f.verdict == "ok" and abs(seen - avail_gib) < 0.5, (f, avail_gib)
    df = H.P.DiskFree("/", 512 << 20)
    (short,) = H.evaluate_disk("h", {"/": (1 << 30, ["logs"])}, {"/": df})
    assert short.verdict == "fail" and "0.5 GiB free on /; needs 1.0 GiB" in short.evidence


def test_memlock_python_and_versions(local: Local) -> None:
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    m = evaluate_memlock(local.exp, local.probe.sh("ulimit -l"), rdma=False, services_mode="process")
    assert ("unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB") in m.evidence
    found = {f.check: f for f in H.run_python(local.probe, local.exp)}
    assert found["python-version"].verdict == "ok" and "%d.%d.%d" % sys.version_info[:3] in found["python-version"].evidence
    assert found["tilepd-version"].verdict == "ok" and __version__ in found["tilepd-version"].evidence
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        assert found["vllm-present"].verdict == "ok"
    # an operator-installed interpreter that is not there, and one of another Python
    gone = PythonEnv(python=str(local.file.parent / "no-python"), install="operator", vllm=True)
    res = local.probe.sh(f"{gone.python} -c pass")
    (f,) = H.evaluate_python_env("h", gone, res, roles=["prefill"])
    assert f.check == "python-version" and f.verdict == "fail" and "no-python" in f.evidence
    old = H.Output(0, json.dumps({"python": "3.10.12", "tilepd": "0.0.9", "vllm": None}) + "\n", "")
    got = {f.check: f for f in H.evaluate_python_env("h", gone, old, roles=["prefill"])}
    assert got["python-version"].verdict == "fail" and got["tilepd-version"].verdict == "fail"
    assert got["tilepd-version"].runbook == "RB-protocol-mismatch" and got["vllm-present"].verdict == "fail"


def test_clock_skew_against_this_host(local: Local) -> None:
    f = H.run_clock(local.probe, local.exp)
    assert f.verdict == "ok"
    assert abs(float(f.evidence.split(" s ")[0])) < 1.0
    late = H.evaluate_clock("h", H.Output(0, "1000.0\n", ""), 990.0, 990.2)
    assert late.verdict == "warn" and late.evidence.startswith("+9.900 s")


def _convert_record(topo: Topology, **options: object) -> dict:
    out = Path(topo.model.weights_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rank0.safetensors").write_bytes(b"\0" * 4096)
    opts = {"family": "llama", "dtype": "bf16", "tp": 1, **options}
    m = {"format": FORMAT, "converter_version": CONVERTER_VERSION, "options": opts, "family": opts["family"], "dtype": opts["dtype"],
         "tp": opts["tp"], "files": [{"file": "rank0.safetensors", "rank": 0, "size": 4096}], "sources": []}
    write_manifest_atomically(out, m)
    return m


def test_weights_manifest_absent_matching_and_mismatched(local: Local) -> None:
    f = H.run_manifest(local.probe, local.exp, local.topo)
    assert f is not None and f.verdict == "warn" and not f.required and "not converted yet" in f.evidence
    _convert_record(local.topo)
    f = H.run_manifest(local.probe, local.exp, local.topo)
    assert f is not None and f.verdict == "ok", f
    _convert_record(local.topo, tp=2)
    f = H.run_manifest(local.probe, local.exp, local.topo)
    assert f is not None and f.verdict == "fail" and "tp 2, the topology wants 1" in f.evidence and f.runbook == "RB-weights-manifest"
    _convert_record(local.topo)
    (Path(local.topo.model.weights_path) / "rank0.safetensors").write_bytes(b"\0" * 100)
    f = H.run_manifest(local.probe, local.exp, local.topo)
    assert f is not None and f.verdict == "fail" and "rank0.safetensors: 100 bytes, manifest says 4096" in f.evidence


def test_api_key_from_the_operator_environment(local: Local) -> None:
    (f,) = H.evaluate_api_key(local.plan, {})
    assert f.verdict == "fail" and "TILEPD_DOCTOR_TEST_KEY" in f.evidence and f.runbook == "RB-api-key-rotation"
    (f,) = H.evaluate_api_key(local.plan, {"TILEPD_DOCTOR_TEST_KEY": "k"})
    assert f.verdict == "ok"


def test_exit_codes() -> None:
    from tilepd.doctor.result import Finding

    ok_ = Finding("port-free", "h", "ok", "")
    info = Finding("clock-skew", "h", "fail", "", required=False)
    down = Finding("ssh", "a", "fail", "")
    bad = Finding("gpu-count", "b", "fail", "")
    assert exit_code([ok_, info]) == ExitCode.OK
    assert exit_code([ok_, down]) == ExitCode.UNREACHABLE
    assert exit_code([down, bad]) == ExitCode.PREFLIGHT


@pytest.mark.slow
def test_cli_json_exit_9_names_the_taken_port(local: Local, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILEPD_DOCTOR_TEST_KEY", "k")
    port = local.topo.router.port
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        r = tilepd(tmp_path / "home", "doctor", str(local.file), "--json")
    assert r.rc == int(ExitCode.PREFLIGHT), r
    doc = r.json()
    failed = [f for f in doc["findings"] if f["verdict"] == "fail" and f["required"]]
    assert [(f["check"], f["runbook"]) for f in failed] == [("port-free", "RB-orphaned-ports")], failed
    assert str(port) in failed[0]["evidence"]
    checks = {f["check"] for f in doc["findings"]}
    assert {"python-version", "tilepd-version", "vllm-present", "memlock", "disk-space", "clock-skew", "weights-manifest", "api-key"} <= checks
    bad = tilepd(tmp_path / "home", "doctor", str(local.file), "--host", "10.9.9.9")
    assert bad.rc == int(ExitCode.USAGE) and "10.9.9.9" in bad.stderr
