"""bench/tp_decode.py's CPU path (gloo, tiny DeepSeek-V3 shapes, 2 ranks) runs end to end and reports its figures."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "tp_decode.py"


@pytest.mark.slow
def test_tp_bench_cpu_path(python_exe: str) -> None:
    out = subprocess.run([python_exe, str(BENCH), "--model", "tiny-dsv3", "--device", "cpu", "--tp", "2", "--context", "16",
                          "--tokens", "4", "--json"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    [row] = report["rows"]
    assert "error" not in row, row
    assert row["tp"] == 2 and row["tokens"] == 4 and row["same_tokens_on_all_ranks"]
    assert row["tokens_per_s"] > 0 and row["floor_tokens_per_s"] > 0 and 0 < row["pct_of_floor"]


INJECT = BENCH.with_name("tp_inject.py")


@pytest.mark.slow
def test_tp_inject_bench_cpu_path(python_exe: str) -> None:
    """Both inject variants run on 2 gloo ranks, each rank ends with exactly its KV heads (the bench checks)."""
    out = subprocess.run([python_exe, str(INJECT), "--device", "cpu", "--tp", "2", "--layers", "3", "--context", "64", "256",
                          "--reps", "1", "--json"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["context"] for r in rows] == [64, 256]
    for r in rows:
        assert r["one_buffer_scatter_ms"] > 0 and r["per_rank_buffers_ms"] > 0 and r["ratio_per_rank_over_one_buffer"] > 0
