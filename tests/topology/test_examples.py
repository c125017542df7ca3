"""Every shipped example validates, and the plan of each says what the issue asks of it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tilepd.plan import build_plan
from tilepd.resources import examples_dir
from tilepd.topology import load_topology

EXAMPLES = sorted(examples_dir().glob("*.yaml"))


def test_the_four_examples_ship() -> None:
    assert {p.name for p in EXAMPLES} >= {"glm51-seed.yaml", "dsv32-multiconnector.yaml", "local.yaml", "lab-3host.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_and_plans(path: Path) -> None:
    plan = build_plan(load_topology(path))
    assert plan.hosts and all(h.services for h in plan.hosts)


def test_local_runs_everything_here_with_this_interpreter() -> None:
    plan = build_plan(load_topology(examples_dir() / "local.yaml"))
    (host,) = plan.hosts
    assert host.local and host.name == "127.0.0.1"
    assert plan.services_mode == "process" and plan.transport == "tcp"
    assert [s.name for s in host.services] == ["tiny-model", "convert-d0", "decode-d0", "prefill-p0", "router"]
    assert {s.python for s in host.services} == {sys.executable}
    home = str(Path.home())
    assert host.base_dir == f"{home}/.local/state/tilepd/local"  # the user's own folder (`~` in local.yaml)
    decode = plan.service("decode-d0")
    assert decode.config["device"] == "cpu" and decode.config["recv_buffer"] == "dram"
    assert decode.config["transport"] == {
        "name": "tcp", "data_port": 18558, "ucx_net_devices": None, "mooncake_protocol": "rdma", "mooncake_devices": None,
    }  # fmt: skip
    # below Linux's default ephemeral range: an outgoing connection's local port cannot take them first
    assert all(10000 <= port < 32768 for s in host.services for port in s.ports.values())
    tiny = plan.service("tiny-model")
    assert tiny.argv[1:] == ["-m", "tilepd", "dev", "tiny-model", "llama", f"{home}/.local/state/tilepd/local/models/tiny-llama"]
    assert tiny.kind == "oneshot" and tiny.creates == f"{home}/.local/state/tilepd/local/models/tiny-llama/config.json"


def test_lab_hosts_and_roles() -> None:
    plan = build_plan(load_topology(examples_dir() / "lab-3host.yaml"))
    roles = {h.address: h.roles for h in plan.hosts}
    assert roles == {"10.77.0.11": ["decode"], "10.77.0.12": ["prefill"], "10.77.0.13": ["router"]}
    assert not any(h.local for h in plan.hosts)
    assert len({h.base_dir for h in plan.hosts}) == 3  # the namespaces share one filesystem
    for h in plan.hosts:
        assert all(s.cwd == h.base_dir and s.log_file.startswith(h.base_dir + "/logs/") for s in h.services)
