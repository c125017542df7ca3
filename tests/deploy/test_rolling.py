"""Supervisor restart rules for rolling restarts: --force, a tilepd upgrade, and a decode node that cannot drain.

Real detached processes (the small HTTP server of test_proc.py, which has /health but no admin API). The
drain itself against real decode nodes under load is tests/router/test_drain_rolling.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from tests.deploy.test_proc import _spec, cleanup  # noqa: F401 - the fixture is used by name
from tilepd.connector.launch import free_port
from tilepd.deploy import probes, proc
from tilepd.plan.model import Health


def test_force_restarts_an_unchanged_service_and_an_upgrade_restarts_it_too(tmp_path: Path, cleanup) -> None:  # noqa: F811
    spec = _spec(tmp_path).model_copy(update={"role": "router"})
    cleanup.append(spec)
    assert proc.start(spec)["action"] == "start" and proc.wait_healthy(spec)["healthy"]
    pid = proc.status(spec)["pid"]
    assert proc.start(spec)["action"] == "none" and proc.status(spec)["pid"] == pid
    forced = proc.start(spec, force=True)
    assert forced["action"] == "restart" and forced["pid"] != pid and "drain" not in forced  # only decode nodes drain
    assert proc.wait_healthy(spec)["healthy"]
    # a state written by another tilepd: the running process is that version's code, so `up` restarts it
    state = json.loads(spec.state_file.read_text())
    spec.state_file.write_text(json.dumps({**state, "tilepd_version": "0.0.1"}))
    assert proc.start(spec, check=True)["action"] == "restart"
    upgraded = proc.start(spec)
    assert upgraded["action"] == "restart" and upgraded["tilepd_version"] != "0.0.1"


def test_a_decode_node_without_the_admin_api_restarts_anyway_and_is_health_gated(tmp_path: Path, cleanup) -> None:  # noqa: F811
    spec = _spec(tmp_path)  # role decode; the server answers GET /health only
    cleanup.append(spec)
    assert proc.start(spec)["action"] == "start" and proc.wait_healthy(spec)["healthy"]
    pid = proc.status(spec)["pid"]
    out = proc.start(spec.model_copy(update={"config_hash": "h2"}))
    assert out["action"] == "restart" and out["pid"] != pid and out["healthy"] is True, out
    assert out["drain"]["drained"] is False and str(spec.health_url).removesuffix("/health") in out["drain"]["error"]
    log = Path(spec.log_file).read_text()
    assert "could not drain before the restart" in log and "restarted after a drain; healthy" in log


def test_cli_force_flag(tmp_path: Path, cleanup, capsys) -> None:  # noqa: F811
    spec = _spec(tmp_path).model_copy(update={"role": "router"})
    cleanup.append(spec)
    path = tmp_path / "svc.spec.json"
    path.write_text(spec.model_dump_json())
    assert proc.main(["start", "--spec", str(path)]) == 0
    pid = json.loads(capsys.readouterr().out)["pid"]
    assert proc.main(["start", "--spec", str(path), "--check", "--force"]) == 0
    assert json.loads(capsys.readouterr().out)["action"] == "restart" and proc.status(spec)["pid"] == pid
    assert proc.main(["start", "--spec", str(path), "--force"]) == 0
    assert json.loads(capsys.readouterr().out)["pid"] != pid


_DRAINING = r"""
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "draining", "idle": True} if self.path == "/health" else {"status": "starting"}).encode()
        self.send_response(503); self.send_header("content-type", "application/json"); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_draining_node_passes_the_health_gate_but_status_shows_it_draining(tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "draining.py"
    script.write_text(_DRAINING)
    server = subprocess.Popen([sys.executable, str(script), str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert proc.probe(url + "/health") == (True, "HTTP 503 draining")  # up on purpose: `up` does not fail on it
        assert proc.probe(url + "/other") == (False, "HTTP 503")  # any other 503 is not
        service = SimpleNamespace(health=Health(url=url + "/health", timeout_s=5))  # probes.health reads only .health
        assert probes.health(service) == (False, "draining")  # status: alive, not serving
    finally:
        server.terminate()
        server.wait(10)
