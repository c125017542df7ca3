"""bench/decode_speed.py's CPU path on tiny shapes, so the GPU benchmark script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama3-8b", "dsv3-small"])
def test_decode_speed_tiny_cpu_runs_every_variant(model: str, repo_root: Path, python_exe: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([python_exe, str(repo_root / "bench" / "decode_speed.py"), "--device", "cpu", "--tiny", "--model", model, "--json"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["bandwidth"]["sum_read_GBps"] > 0
    rows = report["rows"]
    variants = {row["variant"] for row in rows}
    assert {"static", "eager", "hf-generate"} <= variants
    assert all(row["error"] is None for row in rows), [row for row in rows if row["error"]]
    for row in rows:
        assert row["ms_per_token"] > 0 and 0 < row["pct_of_floor"]
        assert str(row["context"]) in report["floor"]
    if model == "dsv3-small":
        spec_rows = [row for row in rows if row["variant"].startswith("mtp-spec")]
        assert spec_rows and "acceptance_rate" in spec_rows[0]["extra"]
