"""`tilepd trace REQUEST_ID --logs DIR`: the timeline read back from the router's, decode node's and connector's log lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from tilepd.cli.app import build_app
from tilepd.contracts.exit_codes import ExitCode

RID = "req-abc123"
TX = "tx-5d1e0c2b"
ROUTER = [
    "2026-11-30 22:01:00,001 INFO tilepd.router event=started nodes_in_rotation=1/1 native_pool=True auth=open",
    f"2026-11-30 22:01:02,100 WARNING tilepd.router req={RID} event=node_fault node=d1 transfer=tx-0aaa status=0 code=silent:deadline "
    "down=True tokens_sent=3 message=x",
    f"2026-11-30 22:01:02,101 INFO tilepd.router req={RID} event=failover from=d1 to=d0 cause=silent",
    f"2026-11-30 22:01:02,500 INFO tilepd.router req={RID} event=done route=low_latency reason=default node=d0 status=200 outcome=ok "
    f"prompt_tokens=5 completion_tokens=20 finish=length ms=512.3 prefill_ms=60.0 failovers=1 user=- transfers=tx-0aaa,{TX} "
    "retries=d1:silent:deadline timeline=admission:0.5,queue_wait:0.1,prefill:120.0,failed_attempt:200.0,kv_wait:10.0,node_queue:0.2,"
    "convert:4.0,inject:1.0,decode:150.0,relay:25.0,respond:1.5,other:0.0 ttft_ms=60.6 node_tokens=16 tokens_per_s=106.7 "
    "detail=transfer:8.0,first_step:9.0",
    "2026-11-30 22:01:03,000 INFO tilepd.router req=req-other event=done route=native reason=unsupported:n status=200 outcome=ok ms=80.0 "
    "runbook=RB-native-fallback fallback=unsupported:n timeline=admission:0.4,native_prefill:40.0,native_decode:39.0,respond:0.6,other:0.0",
]
NODE = [
    f"2026-11-30 22:01:02,300 INFO tilepd.runtime.http event=decode_start transfer_id={TX} req={RID} seq_len=8 max_tokens=17 wait_ms=10.00",
    f"2026-11-30 22:01:02,480 INFO tilepd.runtime.http event=decode_done transfer_id={TX} req={RID} finish=length wait_ms=10.00 "
    "queue_ms=0.20 convert_ms=4.00 inject_ms=1.00 decode_ms=150.00 first_step_ms=9.00 decode_cpu_ms=140.00 tokens=16 tokens_per_s=106.67 "
    "transfer_ms=8.00 node_ms=166.00",
]
PREFILL = [
    "INFO 11-30 22:01:02 [core.py:1] vLLM noise",
    f"2026-11-30 22:01:02,250 INFO tilepd.connector tilepd-connector role=worker event=staged req=cmpl-{RID}-0 transfer_id={TX} seq_len=8 "
    'blocks=1 chunks=1 extract_ms=0.8 extract_total_ms=0.8 window_ms=30.5 counters={"claimed":0}',
    f"2026-11-30 22:01:02,260 INFO tilepd.connector tilepd-connector role=worker event=sent req=cmpl-{RID}-0 transfer_id={TX} "
    'peer=127.0.0.1:5556 bytes=65536 generation=3 retries=0 extract_ms=0.8 extract_total_ms=0.8 queued_ms=0.1 wire_ms=7.5 total_ms=9.2 counters={}',
]


def _logs(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    (d / "router.log.1").write_text(ROUTER[0] + "\n")
    (d / "router.log").write_text("\n".join(ROUTER[1:]) + "\n")
    (d / "decode-d0.log").write_text("\n".join(NODE) + "\n")
    (d / "prefill-p0.log").write_text("\n".join(PREFILL) + "\n")
    return d


def _run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(build_app(["tilepd.cli.trace_cmds"]), list(args))
    return r.exit_code, r.stdout, r.stderr


def test_trace_json_has_every_phase_node_and_connector_details(tmp_path: Path) -> None:
    code, out, _ = _run("trace", RID, "--logs", str(_logs(tmp_path)), "--json")
    assert code == 0, out
    t = json.loads(out)
    assert t["found"] and t["status"] == "200" and t["total_ms"] == 512.3 and t["ttft_ms"] == 60.6
    assert sum(t["phases_ms"].values()) == 512.3
    assert list(t["phases_ms"])[:4] == ["admission", "queue_wait", "prefill", "failed_attempt"]
    assert t["transfers"] == ["tx-0aaa", TX] and t["retries"] == "d1:silent:deadline"
    (node,) = t["nodes"]
    assert node["transfer_id"] == TX and node["decode"] == 150.0 and node["tokens"] == 16 and node["transfer"] == 8.0
    (conn,) = t["connector"]
    assert conn["wire_ms"] == 7.5 and conn["staged.window_ms"] == 30.5 and conn["events"] == ["staged", "sent"]
    assert [e["event"] for e in t["events"]] == ["node_fault", "failover", "done"]
    assert set(t["sources"]) == {"router.log", "decode-d0.log", "prefill-p0.log"}


def test_trace_table_and_fallback_reason(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    code, out, _ = _run("trace", RID, "--logs", str(logs))
    assert code == 0, out
    for text in ("failed_attempt", "kv_wait", "16 tokens", "retries: d1:silent:deadline", "wire ms", "7.5", "failover"):
        assert text in out, text
    code, out, _ = _run("trace", "req-other", "--logs", str(logs), "--json")
    assert code == 0 and json.loads(out)["fallback"] == "unsupported:n" and json.loads(out)["route"] == "native"
    code, out, _ = _run("trace", "req-other", "--logs", str(logs))
    assert "fallback: unsupported:n" in out and "native_decode" in out


def test_trace_not_found_and_bad_folder_exit_codes(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    code, _, err = _run("trace", "req-nope", "--logs", str(logs))
    assert code == ExitCode.NOT_FOUND == 11 and "req-nope" in err and "no final router line" in err
    code, _, _ = _run("trace", "req-abc", "--logs", str(logs))  # a prefix of a real id is not that id
    assert code == ExitCode.NOT_FOUND
    code, _, err = _run("trace", RID, "--logs", str(tmp_path / "missing"))
    assert code == ExitCode.INPUT and "not a folder" in err


def test_trace_does_not_import_torch_or_vllm() -> None:
    code = ("import sys; from tilepd.cli.app import main; sys.argv=['tilepd','trace','--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "bad=[m for m in ('torch','vllm','ansible','opentelemetry') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_trace_reads_a_deployments_logs_on_its_hosts(repo_root: Path, tmp_path: Path) -> None:
    """The topology path: each service's log file (and its rotations) on its host, through the same shell `tilepd logs` uses."""
    from tilepd.deploy.trace import trace_plan
    from tilepd.plan import build_plan
    from tilepd.topology import load_topology

    text = (repo_root / "topology_examples" / "local.yaml").read_text()
    topo = tmp_path / "t.yaml"
    topo.write_text(text.replace("base_dir: ~/.local/state/tilepd/local", f"base_dir: {tmp_path / 'base'}", 1))
    plan = build_plan(load_topology(topo))
    services = {s.role: s for h in plan.hosts for s in h.services}
    for role, lines in (("router", ROUTER), ("decode", NODE), ("prefill", PREFILL)):
        log = Path(services[role].log_file)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("\n".join(lines[1:]) + "\n")
        Path(f"{log}.1").write_text(lines[0] + "\n")  # a rotation, read first
    tr, problems = trace_plan(RID, plan)
    assert problems == [] and tr.found
    t = tr.to_json()
    assert t["total_ms"] == 512.3 and t["nodes"][0]["decode"] == 150.0 and t["connector"][0]["wire_ms"] == 7.5
    assert [e["event"] for e in t["events"]] == ["node_fault", "failover", "done"]
    tr, problems = trace_plan("req-nope", plan)
    assert not tr.found and problems == []


def test_trace_reads_every_router_of_a_deployment(repo_root: Path, tmp_path: Path) -> None:
    """Two routers behind a balancer: the request's lines are in the second router's log, and trace finds them there."""
    from tilepd.deploy.trace import trace_plan
    from tilepd.plan import build_plan
    from tilepd.topology import load_topology

    text = (repo_root / "topology_examples" / "local.yaml").read_text()
    single = "router:\n  name: router\n  address: 127.0.0.1\n  port: 18000\n  queue_timeout_s: 5.0\n"
    assert single in text
    routers = "routers:\n" + "".join(f"  - name: r{i}\n    address: 127.0.0.1\n    port: {18000 + i}\n" for i in range(2))
    topo = tmp_path / "t.yaml"
    topo.write_text(text.replace("base_dir: ~/.local/state/tilepd/local", f"base_dir: {tmp_path / 'base'}", 1).replace(single, routers))
    plan = build_plan(load_topology(topo))
    services = {s.name: s for h in plan.hosts for s in h.services}
    assert {"router-r0", "router-r1"} <= set(services) and "router" not in services
    for name, lines in (("router-r0", ROUTER[:1]), ("router-r1", ROUTER), ("decode-d0", NODE), ("prefill-p0", PREFILL)):
        log = Path(services[name].log_file)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("\n".join(lines) + "\n")
    tr, problems = trace_plan(RID, plan)
    assert problems == [] and tr.found and tr.to_json()["total_ms"] == 512.3
