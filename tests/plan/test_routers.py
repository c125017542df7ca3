"""Several routers in a topology (issue 28 part 2): `routers:` as a list, the single `router:` form unchanged."""

from __future__ import annotations

from pathlib import Path

from tilepd.plan import build_plan
from tilepd.resources import examples_dir
from tilepd.topology import load_topology

SINGLE = "router:\n  name: router\n  address: 127.0.0.1\n  port: 18000\n  queue_timeout_s: 5.0\n"


def _local(tmp_path: Path, router_block: str) -> Path:
    text = (examples_dir() / "local.yaml").read_text()
    assert SINGLE in text
    path = tmp_path / "topology.yaml"
    path.write_text(text.replace("~/.local/state/tilepd/local", str(tmp_path / "base")).replace(SINGLE, router_block))
    return path


def test_the_single_router_form_plans_as_before(tmp_path: Path) -> None:
    plan = build_plan(load_topology(_local(tmp_path, SINGLE)))
    (router,) = [s for h in plan.hosts for s in h.services if s.role == "router"]
    assert router.name == "router" and router.config_file == f"{tmp_path}/base/config/router.json"
    assert router.config["name"] == "router" and router.config["port"] == 18000


def test_each_router_of_the_list_is_its_own_service_over_every_decode_node(tmp_path: Path) -> None:
    block = "routers:\n" + "".join(f"  - name: r{i}\n    address: 127.0.0.1\n    port: {18000 + i}\n    queue_timeout_s: 5.0\n"
                                   for i in range(2))
    plan = build_plan(load_topology(_local(tmp_path, block)))
    routers = [s for h in plan.hosts for s in h.services if s.role == "router"]
    assert [s.name for s in routers] == ["router-r0", "router-r1"]
    assert [s.config["name"] for s in routers] == ["r0", "r1"] and [s.config["port"] for s in routers] == [18000, 18001]
    assert [s.config_file for s in routers] == [f"{tmp_path}/base/config/router-r{i}.json" for i in range(2)]
    assert [s.stage for s in routers] == [4, 4] and all(s.health.url.endswith(f":{s.config['port']}/health") for s in routers)
    nodes = {n["name"] for s in routers for n in s.config["decode_nodes"]}
    assert nodes == {"d0"} and all(s.config["decode_nodes"] == routers[0].config["decode_nodes"] for s in routers)
    assert plan.service("decode-d0").config["reservation_lease_s"] == 10.0  # the default lease


def test_a_decode_nodes_lease_reaches_its_config(tmp_path: Path) -> None:
    path = _local(tmp_path, SINGLE)
    text = path.read_text().replace("    data_port: 18558\n", "    data_port: 18558\n    reservation_lease_s: 4\n")
    path.write_text(text)
    assert build_plan(load_topology(path)).service("decode-d0").config["reservation_lease_s"] == 4.0
