"""Co-located CPU vLLM services get disjoint cores (issue 13 part 8); the operator's own binding wins."""

from __future__ import annotations

from tilepd.plan import build_plan
from tilepd.contracts.cpu_bind import BIND_ENV, parse_cpu_list
from tilepd.plan.cpu_cores import CpuVllm, split_cores
from tilepd.resources import examples_dir
from tilepd.topology import load_topology_text

LOCAL = (examples_dir() / "local.yaml").read_text()
NATIVE = """
native_decode:
  - name: n0
    address: 127.0.0.1
    gpus: 0
    port: 18200
    nixl_side_channel_port: 18600
"""


def _topo(text: str):
    text = text.replace("transport:\n  name: tcp\n", "transport:\n  name: nixl\n")
    return load_topology_text(text.replace("\ndecode:\n", NATIVE + "\ndecode:\n", 1), "t.yaml")


def test_prefill_and_native_decode_on_one_host_get_disjoint_cores() -> None:
    topo = _topo(LOCAL)
    two = build_plan(topo, local_cores=[0, 1])
    assert two.service("prefill-p0").env[BIND_ENV] == "0" and two.service("native-decode-n0").env[BIND_ENV] == "1"
    # with cores to spare the first one is left to the decode node and router on the same host; the native decode
    # holds the last core, where vLLM's NixlConnector pins its worker's main thread (tilepd/connector/cpu_binding.py)
    nine = build_plan(topo, local_cores=range(9))
    assert nine.service("prefill-p0").env[BIND_ENV] == "1-4" and nine.service("native-decode-n0").env[BIND_ENV] == "5-8"
    assert BIND_ENV not in nine.service("decode-d0").env and BIND_ENV not in nine.service("router").env
    # the plan's JSON (what `tilepd plan --json` prints) carries it, and the config hash follows it
    assert '"VLLM_CPU_OMP_THREADS_BIND": "0"' in two.model_dump_json(indent=1)
    assert two.service("prefill-p0").config_hash != nine.service("prefill-p0").config_hash


def test_nothing_bound_alone_on_one_core_or_on_a_remote_host() -> None:
    assert BIND_ENV not in build_plan(load_topology_text(LOCAL, "t.yaml"), local_cores=[0, 1]).service("prefill-p0").env  # one vLLM
    assert BIND_ENV not in build_plan(_topo(LOCAL), local_cores=[3]).service("prefill-p0").env  # two ranks, one core
    remote = _topo(LOCAL.replace("127.0.0.1", "10.9.0.1").replace("python: current", "python: /usr/bin/python3").replace("~/", "/srv/"))
    assert BIND_ENV not in build_plan(remote, local_cores=[0, 1]).service("native-decode-n0").env  # its cores are unknown


def test_the_operators_binding_wins_and_its_cores_are_left_to_it() -> None:
    text = LOCAL.replace("      VLLM_CPU_KVCACHE_SPACE: \"1\"\n", "      VLLM_CPU_KVCACHE_SPACE: \"1\"\n      VLLM_CPU_OMP_THREADS_BIND: \"0-1\"\n")
    plan = build_plan(_topo(text), local_cores=range(4))
    assert plan.service("prefill-p0").env[BIND_ENV] == "0-1"
    assert plan.service("native-decode-n0").env[BIND_ENV] == "3"  # core 2 kept for the decode node and router


def test_tensor_parallel_ranks_get_one_list_each() -> None:
    out = split_cores(range(8), [CpuVllm("prefill-p0", 2, {}), CpuVllm("native-decode-n0", 2, {})], other_services=False)
    assert out == {"prefill-p0": "0-1|2-3", "native-decode-n0": "4-5|6-7"}
    # whatever the topology's order, the native decode takes the last cores
    out = split_cores(range(4), [CpuVllm("native-decode-n0", 1, {}), CpuVllm("prefill-p0", 1, {})], other_services=True)
    assert out == {"prefill-p0": "2", "native-decode-n0": "3"}, out  # core 0 kept for tilepd's services, core 1 left over
    assert split_cores([0, 2, 3, 5], [CpuVllm("a", 1, {}), CpuVllm("b", 1, {})], other_services=False) == {"a": "0,2", "b": "3,5"}
    assert parse_cpu_list("0-2|5,7") == {0, 1, 2, 5, 7} and parse_cpu_list("auto") is None and parse_cpu_list("1-") is None


def test_plan_table_shows_the_cores(tmp_path, monkeypatch) -> None:
    import os

    from typer.testing import CliRunner

    from tilepd.cli.app import app

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # what `tilepd plan` finds on a 2-core box
    text = LOCAL.replace("transport:\n  name: tcp\n", "transport:\n  name: nixl\n").replace("\ndecode:\n", NATIVE + "\ndecode:\n", 1)
    (tmp_path / "t.yaml").write_text(text)
    out = CliRunner().invoke(app, ["plan", str(tmp_path / "t.yaml")], env={"COLUMNS": "250"}).output
    assert "prefill-p0 (daemon) cores 0" in out and "native-decode-n0 (daemon) cores 1" in out, out
