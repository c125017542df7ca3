"""Golden files pin the rendered vLLM argv and kv-transfer-config of the two production examples.

A change here is a change of what runs in production: regenerate deliberately with
`TILEPD_UPDATE_GOLDEN=1 pytest tests/plan/test_golden.py` and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tilepd.plan import build_plan, render_plan
from tilepd.resources import examples_dir
from tilepd.topology import load_topology

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("TILEPD_UPDATE_GOLDEN") == "1"

CASES = [
    ("glm51-seed", "10.0.0.10", "prefill-p0"),
    ("dsv32-multiconnector", "10.0.1.10", "prefill-p0"),
    ("dsv32-multiconnector", "10.0.1.30", "native-decode-n0"),
]


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with TILEPD_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from the golden file"


@pytest.mark.parametrize(("example", "host", "service"), CASES)
def test_vllm_argv_and_kv_transfer_config(tmp_path: Path, example: str, host: str, service: str) -> None:
    plan = build_plan(load_topology(examples_dir() / f"{example}.yaml"))
    svc = plan.service(service)
    _check(f"{example}.{service}.argv.json", json.dumps(svc.argv, indent=1) + "\n")
    render_plan(plan, tmp_path / "out")
    rendered = tmp_path / "out" / "hosts" / host / ("kv-transfer-config.json" if svc.role == "prefill" else f"config/{service}.json")
    _check(f"{example}.{service}.kv-transfer-config.json", rendered.read_text())
    assert json.loads(rendered.read_text()) == json.loads(svc.argv[svc.argv.index("--kv-transfer-config") + 1])
