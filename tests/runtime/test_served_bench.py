"""bench/served_decode.py's CPU path (tiny Llama): the served node's tokens are the engine's own, every
figure of the report is there, so the GPU benchmark script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_served_decode_tiny_cpu(repo_root: Path, python_exe: str) -> None:
    contexts, tokens = [40, 100], 24
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo_root)}
    r = subprocess.run([python_exe, str(repo_root / "bench" / "served_decode.py"), "--device", "cpu", "--tiny", "--json", "--reps", "1",
                        "--tokens", str(tokens), "--contexts", *map(str, contexts)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["node"]["authenticated"] and report["weights"]["GB"] > 0
    assert [row["context"] for row in report["rows"]] == contexts
    for row in report["rows"]:
        assert "error" not in row, row
        # the streamed tokens are exactly what the same engine decodes alone from the same received KV
        assert row["tokens_match"] and row["served_tokens"] == tokens
        # the KV crossed the control protocol in vLLM's block layout: 2 layers x 16-token blocks x 2 heads x (16 K + 16 V) fp32
        assert row["kv_bytes"] == 2 * -(-row["context"] // 16) * 16 * 2 * 32 * 4
        assert row["served_ms_per_token"] > 0 and row["engine_ms_per_token"] > 0 and row["speed_ratio"] > 0
        # the first token comes after the KV landed; the sender's ack can be stamped after the reader thread stamped
        # that token (the node acks, then decodes: two threads here race for the clock), so only its order is checked
        assert row["kv_acked_to_first_token_ms"] <= row["kv_landed_to_first_token_ms"] and row["kv_landed_to_first_token_ms"] > 0
        assert row["node_convert_ms"] > 0 and row["node_first_step_ms"] > 0
        assert row["loop_cpu_us_per_token"] > 0 and row["host_cpu_us_per_token_served"] > 0
