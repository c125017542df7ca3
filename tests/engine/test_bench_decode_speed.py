"""bench/decode_speed.py's CPU path on tiny shapes, so the GPU benchmark script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("model,extra_args", [("llama3-8b", []), ("dsv3-small", []), ("dsv3-small", ["--weights", "fp8"]), ("glm5-small", [])])
def test_decode_speed_tiny_cpu_runs_every_variant(model: str, extra_args: list[str], repo_root: Path, python_exe: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([python_exe, str(repo_root / "bench" / "decode_speed.py"), "--device", "cpu", "--tiny", "--model", model, "--json", *extra_args],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["bandwidth"]["sum_read_GBps"] > 0
    rows = report["rows"]
    variants = {row["variant"] for row in rows}
    assert {"static", "eager"} <= variants
    assert ("hf-generate" in variants) == ("fp8" not in extra_args)  # HF would run other (bf16) weights
    assert report["weights"] == ("fp8" if extra_args else "bf16")
    assert all(row["error"] is None for row in rows), [row for row in rows if row["error"]]
    for row in rows:
        assert row["ms_per_token"] > 0 and 0 < row["pct_of_floor"]
        assert str(row["context"]) in report["floor"]
    if model == "glm5-small":  # the DSA floor: 2 layers x (16 selected 80-wide latent rows + all 32-wide indexer keys), fp32
        assert report["floor"]["32"]["kv_GB"] * 1e9 == pytest.approx(2 * (16 * 80 + 32 * 32) * 4)
        assert report["floor"]["64"]["kv_GB"] * 1e9 == pytest.approx(2 * (16 * 80 + 64 * 32) * 4)
    if model in ("dsv3-small", "glm5-small"):
        spec_rows = [row for row in rows if row["variant"].startswith("mtp-spec")]
        assert spec_rows and "acceptance_rate" in spec_rows[0]["extra"]
