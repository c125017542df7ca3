"""GPU and RDMA checks against recorded outputs of nvidia-smi, ibv_devinfo, ibv_devices, sysfs, lsmod, ucx_info.

This machine has no GPU and no RDMA NIC: the verdicts are checked on the tools' output formats
(tests/doctor/fixtures/SOURCES.md), and the live run of these tools is skipped with the reason.
"""

from __future__ import annotations

import shutil

import pytest

from tilepd.deploy.remote import Output
from tilepd.doctor import parsers as P
from tilepd.doctor.checks_hw import evaluate_gpus, evaluate_memlock, evaluate_peermem, evaluate_rdma, evaluate_ucx
from tests.doctor.helpers import fixture, seed_host, with_gpus, with_nics

MISSING = Output(127, "", "sh: 1: tool: not found")


def by_check(findings):  # noqa: ANN001, ANN201
    out: dict[str, list] = {}
    for f in findings:
        out.setdefault(f.check, []).append(f)
    return out


def test_nvidia_smi_both_unit_formats() -> None:
    idle = P.nvidia_smi_gpus(fixture("nvidia_smi_h200x8_idle.csv").stdout)
    assert [g.index for g in idle] == list(range(8))
    assert idle[0].name == "NVIDIA H200" and idle[0].driver == "570.86.15"
    assert idle[0].total_bytes == 143771 * P.MIB and idle[0].free_bytes == 143187 * P.MIB
    busy = P.nvidia_smi_gpus(fixture("nvidia_smi_h100x2_busy_units.csv").stdout)
    assert busy[0].used_bytes == 61440 * P.MIB and busy[1].free_bytes == 80966 * P.MIB
    assert P.nvidia_smi_gpus(fixture("nvidia_smi_no_driver.txt").stdout) == []


def test_gpus_match_count_type_driver_and_free_memory() -> None:
    exp = with_gpus(seed_host("decode"), 8, "H200")
    verdicts = {f.check: f.verdict for f in evaluate_gpus(exp, fixture("nvidia_smi_h200x8_idle.csv"))}
    assert verdicts == {"gpu-count": "ok", "gpu-type": "ok", "gpu-driver": "ok", "gpu-free-memory": "ok"}


def test_the_seed_topology_on_h200s_fails_the_type() -> None:
    findings = by_check(evaluate_gpus(seed_host("decode"), fixture("nvidia_smi_h200x8_idle.csv")))
    (t,) = findings["gpu-type"]
    assert t.verdict == "fail" and "B200" in t.evidence and "NVIDIA H200" in t.evidence


def test_busy_old_driver_and_too_few_gpus() -> None:
    exp = with_gpus(seed_host("decode"), 4, "H100")
    f = by_check(evaluate_gpus(exp, fixture("nvidia_smi_h100x2_busy_units.csv")))
    assert f["gpu-count"][0].verdict == "fail" and "2 GPU(s) seen; the topology needs 4" in f["gpu-count"][0].evidence
    assert f["gpu-type"][0].verdict == "ok"
    assert f["gpu-driver"][0].verdict == "fail" and "535.183.01 < 570.26" in f["gpu-driver"][0].evidence
    free = f["gpu-free-memory"][0]
    assert free.verdict == "fail" and "GPU 0: 19.1 of 79.6 GiB free" in free.evidence and "GPU 1" not in free.evidence
    assert free.runbook == "RB-orphaned-ports"


def test_no_driver_and_no_nvidia_smi_fail_where_gpus_are_needed() -> None:
    exp = seed_host("decode")
    (f,) = evaluate_gpus(exp, Output(9, fixture("nvidia_smi_no_driver.txt").stdout, ""))
    assert f.verdict == "fail" and "exit 9" in f.evidence and "couldn't communicate with the NVIDIA driver" in f.evidence
    (f,) = evaluate_gpus(exp, MISSING)
    assert f.verdict == "fail" and "nvidia-smi not found" in f.evidence
    (f,) = evaluate_gpus(seed_host("router"), None)
    assert f.verdict == "skip"


def test_rdma_parsers() -> None:
    assert P.ibv_devices(fixture("ibv_devices.txt").stdout) == ["mlx5_0", "mlx5_1"]
    info = P.ibv_devinfo(fixture("ibv_devinfo_two_hcas.txt").stdout)
    assert info["mlx5_0"].ports[1].state == "PORT_ACTIVE" and info["mlx5_0"].ports[1].link_layer == "InfiniBand"
    assert info["mlx5_1"].ports[1].state == "PORT_DOWN" and info["mlx5_1"].ports[1].link_layer == "Ethernet"
    assert P.sysfs_port_states(fixture("sysfs_port_states.txt").stdout) == {"mlx5_0": {1: "ACTIVE"}, "mlx5_1": {1: "DOWN"}}
    gids = P.sysfs_gids(fixture("sysfs_gids.txt").stdout)
    assert not P.gid_is_zero(gids[("mlx5_0", 1)][0]) and all(P.gid_is_zero(g) for g in gids[("mlx5_1", 1)])


@pytest.mark.parametrize("use_devinfo", [True, False], ids=["ibv_devinfo", "sysfs"])
def test_rdma_devices_ports_and_gids(use_devinfo: bool) -> None:
    exp = with_nics(seed_host("decode"), "mlx5_0", "mlx5_1")
    devinfo = fixture("ibv_devinfo_two_hcas.txt") if use_devinfo else MISSING
    f = by_check(evaluate_rdma(exp, fixture("ibv_devices.txt"), devinfo, fixture("sysfs_port_states.txt"), fixture("sysfs_gids.txt")))
    assert [x.verdict for x in f["rdma-devices"]] == ["ok"]
    ports = {x.evidence.split(":")[0]: x for x in f["rdma-port-active"]}
    assert ports["mlx5_0"].verdict == "ok" and ports["mlx5_1"].verdict == "fail"
    assert ("PORT_DOWN" if use_devinfo else "DOWN") in ports["mlx5_1"].evidence and ports["mlx5_1"].runbook == "RB-kv-timeout"
    assert [(x.verdict, x.evidence.split(":")[0]) for x in f["rdma-gid"]] == [("ok", "mlx5_0 port 1")]


def test_a_named_nic_that_is_absent_and_a_zero_gid() -> None:
    exp = with_nics(seed_host("decode"), "mlx5_0", "mlx5_2")
    (dev, *_) = evaluate_rdma(exp, fixture("ibv_devices.txt"), fixture("ibv_devinfo_two_hcas.txt"), fixture("sysfs_port_states.txt"), fixture("sysfs_gids.txt"))
    assert dev.verdict == "fail" and "mlx5_2 not present" in dev.fix
    # mlx5_1's link up (sysfs, no ibv_devinfo) but its netdev has no address: only zero GIDs
    states = Output(0, fixture("sysfs_port_states.txt").stdout.replace("1: DOWN", "4: ACTIVE"), "")
    listing = Output(127, "mlx5_0\nmlx5_1\n", "")  # `ls -1 /sys/class/infiniband` where ibv_devices is absent
    f = by_check(evaluate_rdma(with_nics(exp, "mlx5_1"), listing, MISSING, states, fixture("sysfs_gids.txt")))
    assert f["rdma-devices"][0].verdict == "ok" and f["rdma-port-active"][0].verdict == "ok"
    assert f["rdma-gid"][0].verdict == "fail" and "only zero GIDs" in f["rdma-gid"][0].evidence


def test_peermem_memlock_and_ucx() -> None:
    exp = with_nics(seed_host("decode"), "mlx5_0")
    assert evaluate_peermem(exp, fixture("lsmod_peermem.txt")).verdict == "ok"
    missing = evaluate_peermem(exp, fixture("lsmod_no_peermem.txt"))
    assert missing.verdict == "fail" and missing.required and "modprobe nvidia-peermem" in missing.fix
    assert evaluate_peermem(seed_host("router"), fixture("lsmod_no_peermem.txt")).verdict == "skip"
    assert evaluate_memlock(exp, Output(0, "65536\n", ""), rdma=True, services_mode="process").verdict == "fail"
    assert evaluate_memlock(exp, Output(0, "unlimited\n", ""), rdma=True, services_mode="process").verdict == "ok"
    sd = evaluate_memlock(exp, Output(0, "65536\n", ""), rdma=True, services_mode="systemd")
    assert sd.verdict == "ok" and not sd.required and "LimitMEMLOCK=infinity" in sd.evidence
    ucx = fixture("ucx_info_d.txt")
    assert {(t.transport, t.device) for t in P.ucx_info_devices(ucx.stdout)} >= {("rc_mlx5", "mlx5_0:1"), ("tcp", "ens3"), ("self", "memory")}
    good = evaluate_ucx(exp, ucx)
    assert good.verdict == "ok" and "rc_mlx5" in good.evidence and "tcp" not in good.evidence
    bad = evaluate_ucx(with_nics(exp, "mlx5_0", "mlx5_1"), ucx)
    assert bad.verdict == "fail" and "mlx5_1" in bad.evidence
    assert evaluate_ucx(exp, MISSING).verdict == "skip"


@pytest.mark.parametrize("tool", ["nvidia-smi", "ibv_devinfo", "ucx_info"])
def test_live_hardware_tools(tool: str) -> None:
    """Where the tool exists, its live output must parse; here it usually does not (stated)."""
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed on this machine (no {'GPU' if tool == 'nvidia-smi' else 'RDMA NIC'}): covered by recorded output")
    import subprocess

    if tool == "nvidia-smi":
        from tilepd.doctor.checks_hw import NVIDIA_SMI

        out = subprocess.run(NVIDIA_SMI, shell=True, capture_output=True, text=True).stdout
        assert P.nvidia_smi_gpus(out)
    elif tool == "ibv_devinfo":
        assert P.ibv_devinfo(subprocess.run([tool], capture_output=True, text=True).stdout)
    else:
        assert P.ucx_info_devices(subprocess.run([tool, "-d"], capture_output=True, text=True).stdout)
