"""`tilepd capacity`: a stated load, a live window read from a server rendering the router's own metrics, the errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from tests.capacity.helpers import REPO, drive, local_topology, router_metrics, serving_metrics
from tilepd.capacity.queueing import predict
from tilepd.cli.app import build_app

APP = build_app(["tilepd.cli.capacity_cmds"])
LOCAL = str(REPO / "topology_examples" / "local.yaml")
STATED = ["--rps", "3", "--output-tokens", "200", "--ms-per-token", "5", "--prefill-ms", "100", "--sim-requests", "20000"]


def _run(*args: str):  # noqa: ANN202
    return CliRunner().invoke(APP, ["capacity", *args])


def test_stated_load_json() -> None:
    r = _run(LOCAL, *STATED, "--service-cv", "0.5", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["load"]["service_mean_s"] == pytest.approx(0.1 + 200 * 0.005)
    assert out["load"]["queue_timeout_s"] == 5.0  # local.yaml's router
    cur = out["current"]
    assert cur["nodes"] == 1  # local.yaml has one decode node
    want = predict(3.0, 1.1, 0.5, 1, 5.0)
    assert cur["formula"]["p_timeout"] == pytest.approx(want.p_timeout)
    assert cur["meets_targets"] is False
    rows = {row["nodes"]: row for row in out["rows"]}
    needed = out["nodes_needed"]
    assert rows[needed]["meets_targets"] and not rows[needed - 1]["meets_targets"]
    assert needed >= out["nodes_needed_formula"] >= 4  # 3.3 erlangs
    f = rows[needed]["formula"]
    assert f["p99_wait_s"] <= 0.1 and f["p_timeout"] <= 0.01


def test_check_exit_codes_and_table() -> None:
    assert _run(LOCAL, *STATED, "--check").exit_code == 7  # one node for 3.3 erlangs
    r = _run(LOCAL, *STATED, "--nodes", "12", "--check")
    assert r.exit_code == 0, r.output
    assert "meets the targets" in r.stdout and "needed" in r.stdout


@pytest.mark.parametrize(("args", "named"), [
    (["--rps", "3"], "--output-tokens"),
    (["--output-tokens", "100"], "--rps"),
    (["--rps", "0", "--output-tokens", "100"], "--rps"),
])
def test_bad_options_exit_2(args: list[str], named: str) -> None:
    r = _run(LOCAL, *args)
    assert r.exit_code == 2
    assert named in r.output


def test_unreachable_metrics_endpoint_is_named(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run(str(local_topology(tmp_path, port)), "--window", "1")
    assert r.exit_code == 7
    assert f"http://127.0.0.1:{port}/metrics" in r.stderr
    # the decode node of a stated load without --ms-per-token is read from its /metrics: also named
    r = _run(str(local_topology(tmp_path, port)), "--rps", "1", "--output-tokens", "10", "--prefill-ms", "1")
    assert r.exit_code == 7 and "18557/metrics" in r.stderr


@pytest.fixture
def fake_router() -> Iterator[int]:
    """Serves the router's own RouterMetrics; the load arrives between the first and the second scrape."""
    metrics, _ = router_metrics(nodes=1)
    with serving_metrics(metrics, lambda: drive(metrics, served=20, hold_s=0.25, wait_s=0.05, refused=1)) as port:
        yield port


def test_live_window_from_the_router_metrics(tmp_path: Path, fake_router: int) -> None:
    r = _run(str(local_topology(tmp_path, fake_router)), "--window", "1", "--sim-requests", "20000", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    measured = out["measured"]
    assert measured["rate_per_s"] == pytest.approx(21.0)  # 20 leased + 1 refused in a 1 s window
    assert measured["busy_429"] == 1 and measured["busy_fraction"] == pytest.approx(1 / 21)
    assert measured["utilisation"] == pytest.approx(20 * 0.25)  # more than one node can carry: overloaded
    assert out["load"]["service_mean_s"] == pytest.approx(0.25)
    assert out["load"]["source"].startswith("live: router 127.0.0.1:")
    assert out["nodes_needed"] >= 6  # 5.25 erlangs
    assert any("Poisson" in n for n in out["notes"])


def test_capacity_imports_no_torch() -> None:
    code = ("import sys; from tilepd.cli.app import main\n"
            f"try:\n    main(['capacity', {LOCAL!r}, *{STATED!r}])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip().splitlines()[-1] == "False False", out.stdout + out.stderr
