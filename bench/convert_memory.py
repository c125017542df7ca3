"""Peak memory of `tilepd convert-weights` on a ~2 GB checkpoint made at run time (target: < 1 GB above
the largest tensor).

    python bench/convert_memory.py            # 2 GB float32 Llama-shaped checkpoint -> bf16
    python bench/convert_memory.py --gb 4 --json

The conversion runs as a child process (the real CLI); its peak RSS comes from the kernel's
high-water mark (getrusage RUSAGE_CHILDREN), and a child that only imports the same modules gives the
interpreter baseline, measured the same way in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilepd.dev.synthetic import llama_tensor_shapes, make_synthetic_llama


def _child_peak_rss(argv: list[str]) -> tuple[int, float]:
    """Run argv to completion; (its peak RSS in bytes, seconds). One child at a time, so the
    RUSAGE_CHILDREN high-water mark after it exits is this child's unless an earlier child was larger."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="peak RSS of convert-weights")
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size to generate (float32)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    hidden, inter, vocab, heads, kv = 2048, 8192, 32000, 16, 4
    per_layer = sum(4 * n for name, s in llama_tensor_shapes(hidden, 1, inter, vocab, heads, kv) if ".layers.0." in name for n in [s[0] * (s[1] if len(s) > 1 else 1)])
    fixed = 2 * 4 * vocab * hidden
    layers = max(1, round((args.gb * 1e9 - fixed) / per_layer))
    with tempfile.TemporaryDirectory(prefix="tilepd-convert-mem-") as tmp:
        src = make_synthetic_llama(Path(tmp) / "src", hidden=hidden, layers=layers, intermediate=inter, vocab=vocab, heads=heads,
                                   kv_heads=kv, shard_bytes=1 << 30)
        ckpt_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        shapes = llama_tensor_shapes(hidden, layers, inter, vocab, heads, kv)
        largest = max(4 * s[0] * (s[1] if len(s) > 1 else 1) for _, s in shapes)
        py = sys.executable
        # Baseline first (smaller), so the high-water mark after the conversion is the conversion's.
        base, _ = _child_peak_rss([py, "-c", "import torch, tilepd.cli.app, tilepd.weights.convert, rich.progress"])
        peak, secs = _child_peak_rss([py, "-m", "tilepd", "convert-weights", "--model-dir", str(src), "--out", str(Path(tmp) / "out"),
                                      "--dtype", args.dtype, "--json"])
        _, skip_secs = _child_peak_rss([py, "-m", "tilepd", "convert-weights", "--model-dir", str(src), "--out", str(Path(tmp) / "out"),
                                        "--dtype", args.dtype, "--json"])
    report = {
        "checkpoint_GB": ckpt_bytes / 1e9, "layers": layers, "largest_tensor_GB": largest / 1e9,
        "peak_rss_GB": peak / 1e9, "baseline_rss_GB": base / 1e9,
        "peak_above_largest_GB": (peak - largest) / 1e9, "peak_above_baseline_plus_largest_GB": (peak - base - largest) / 1e9,
        "convert_seconds": secs, "rerun_skip_seconds_incl_startup": skip_secs, "target_GB": 1.0,
        "ok": (peak - largest) / 1e9 < 1.0,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}")
    return report


if __name__ == "__main__":
    main()
