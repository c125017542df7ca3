"""`tilepd doctor` over real SSH (paramiko) into the deploy tests' network-namespace hosts
(on 10.77.1.11/.12/.13, each with its own sshd): the checks run there, a port taken inside one
namespace is seen there only, and a host whose sshd is stopped is one failed `ssh` finding (exit 5)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import topo as topo_files
from tests.deploy.netns import LabNetwork
from tilepd.contracts.exit_codes import ExitCode
from tilepd.doctor import exit_code
from tilepd.doctor.runner import run_doctor
from tilepd.plan import build_plan
from tilepd.topology import load_topology

from tests.doctor.conftest import ADDRESSES

pytestmark = pytest.mark.slow

DECODE, PREFILL, ROUTER = ADDRESSES
_LAB = {"10.77.0.11": DECODE, "10.77.0.12": PREFILL, "10.77.0.13": ROUTER}


def test_doctor_over_ssh(doctor_lab: LabNetwork, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import paramiko.channel

    lab_network = doctor_lab
    # no command's stdin file is ever made: its close (from __del__, on whichever thread a garbage collection runs)
    # takes the channel's lock, and on the transport thread closing that channel it deadlocked a whole doctor run
    # (remote.HostShell._exec); the spy counts them on the real paramiko
    stdin_files = []
    made = paramiko.channel.ChannelStdinFile.__init__
    monkeypatch.setattr(paramiko.channel.ChannelStdinFile, "__init__", lambda self, *a, **kw: stdin_files.append(1) or made(self, *a, **kw))
    data = topo_files.lab_topology(tmp_path, lab_network.client_key, name="t-doctor")
    for entry in [*data["prefill"], *data["decode"], data["router"]]:
        entry["address"] = _LAB[entry["address"]]
    file = topo_files.write(data, tmp_path / "lab.yaml")
    topo = load_topology(file)
    plan = build_plan(topo)
    known = tmp_path / "known_hosts"
    router_ns = next(h for h in lab_network.hosts if h.address == ROUTER).netns
    holder = subprocess.Popen(["ip", "netns", "exec", router_ns, sys.executable, "-c",
                               "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 8080)); s.listen(); print('up', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        findings = run_doctor(topo, plan, known_hosts=known, live=True)
    finally:
        holder.kill()
        holder.wait()
    by = {(f.host, f.check, f.evidence.split()[0] if f.check == "port-free" else ""): f for f in findings}
    for host in (DECODE, PREFILL, ROUTER):
        assert by[(host, "ssh", "")].verdict == "ok"
        assert by[(host, "python-version", "")].verdict == "ok" and by[(host, "tilepd-version", "")].verdict == "ok"
        assert by[(host, "clock-skew", "")].verdict == "ok"
    taken = by[(ROUTER, "port-free", "8080")]
    assert taken.verdict == "fail" and f"pid {holder.pid}" in taken.evidence and "0.0.0.0:8080" in taken.evidence
    # the namespaces are separate hosts: the decode and prefill ports are free there
    assert {f.verdict for f in findings if f.check == "port-free" and f.host != ROUTER} == {"ok"}
    assert by[(PREFILL, "vllm-present", "")].verdict in ("ok", "warn")
    assert exit_code(findings) == ExitCode.PREFLIGHT
    assert not stdin_files, f"{len(stdin_files)} stdin files made"

    decode = next(h for h in lab_network.hosts if h.address == DECODE)
    lab_network.stop_sshd(decode)
    try:
        findings = run_doctor(topo, plan, known_hosts=known, live=False)
    finally:
        lab_network.start_sshd(decode)
    (down,) = [f for f in findings if f.host == DECODE]
    assert down.check == "ssh" and down.verdict == "fail" and down.runbook == "RB-host-unreachable"
    assert {f.verdict for f in findings if f.host != DECODE and f.required} <= {"ok", "skip", "warn"}
    assert exit_code(findings) == ExitCode.UNREACHABLE
