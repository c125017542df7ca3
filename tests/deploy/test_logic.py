"""Pure logic of the deploy side: limits, exit codes, ansible messages, metrics parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy import topo
from tilepd.contracts.exit_codes import ExitCode
from tilepd.deploy import deployment
from tilepd.deploy.probes import metric_sum, parse_metrics
from tilepd.deploy.runner import PlaybookResult, TaskFailure, _message


@pytest.fixture
def lab(tmp_path: Path) -> deployment.Deployment:
    file = topo.write(topo.lab_topology(tmp_path, tmp_path / "key"), tmp_path / "lab.yaml")
    return deployment.load(file, state_dir=tmp_path / "state")


def test_limit_accepts_addresses_and_entry_names(lab: deployment.Deployment) -> None:
    assert deployment.resolve_limit(lab, None) is None
    assert deployment.resolve_limit(lab, "router") == "10.77.0.13"
    assert deployment.resolve_limit(lab, "d0,10.77.0.12") == "10.77.0.11,10.77.0.12"
    with pytest.raises(ValueError, match="no such host"):
        deployment.resolve_limit(lab, "nope")


def test_exit_codes_follow_the_worst_failure() -> None:
    ok = PlaybookResult("up.yml", "successful", 0)
    assert deployment.exit_code(ok) == ExitCode.OK
    task = PlaybookResult("up.yml", "failed", 2, failures=[TaskFailure("h", "t", "boom")])
    assert deployment.exit_code(task) == ExitCode.TASK_FAILED
    health = PlaybookResult("up.yml", "failed", 2, failures=[TaskFailure("h", "health gate: decode", "x", health=True)])
    assert deployment.exit_code(health) == ExitCode.UNHEALTHY
    both = PlaybookResult("up.yml", "failed", 4, failures=[*health.failures, TaskFailure("h2", "Reach", "refused", unreachable=True)])
    assert deployment.exit_code(both) == ExitCode.UNREACHABLE
    assert deployment.exit_code(PlaybookResult("up.yml", "canceled", 1)) == ExitCode.TASK_FAILED


def test_module_messages_prefer_tilepd_json_and_name_the_failed_item() -> None:
    res = {"msg": "non-zero return code", "stdout": '{"failed": true, "msg": "convert-weights failed: bad tensor"}', "stderr": ""}
    assert _message(res) == "convert-weights failed: bad tensor"
    loop = {"msg": "One or more items failed", "results": [{"failed": False}, {"failed": True, "item": {"name": "router"}, "msg": "non-zero return code", "stderr": "Traceback: oops"}]}
    assert _message(loop) == "[router] non-zero return code: Traceback: oops"


def test_prometheus_text_is_parsed_with_labels() -> None:
    text = """# HELP x
vllm:num_requests_running{model_name="m",engine="0"} 2.0
vllm:num_requests_waiting{model_name="m",engine="0"} 1.0
tilepd_router_responses_total{route="low_latency",status="429"} 3.0
tilepd_router_responses_total{route="native",status="429"} 1.0
tilepd_router_responses_total{route="native",status="200"} 9.0
"""
    s = parse_metrics(text)
    assert metric_sum(s, "vllm:num_requests_running") == 2.0
    assert metric_sum(s, "tilepd_router_responses_total", status="429") == 4.0
    assert metric_sum(s, "absent") is None


def test_host_vars_carry_specs_and_cpu_convert_options(lab: deployment.Deployment) -> None:
    from tilepd.deploy.inventory import host_vars

    deployment.render(lab)
    decode = lab.plan.host("10.77.0.11")
    hv = host_vars(lab.plan, lab.topology, decode, lab.render_dir)
    assert hv["tilepd_model"]["convert"] and hv["tilepd_model"]["dtype"] == "fp32"  # a `cpu` node computes in float32
    (svc,) = hv["tilepd_deploy_services"]
    assert svc["role"] == "decode" and svc["spec_file"].startswith(decode.base_dir + "/run/")
    paths = [f["path"] for f in hv["tilepd_bundle"]["files"]]
    assert svc["spec_file"] in paths and any(p.endswith("/config/decode-d0.json") for p in paths)
    assert (lab.render_dir / "host_vars" / "10.77.0.11.yml").stat().st_mode & 0o077 == 0
