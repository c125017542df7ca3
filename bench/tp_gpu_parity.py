"""2 GPUs (NCCL, CUDA graphs per rank) decode exactly the greedy tokens 1 GPU decodes.

The GPU counterpart of tests/tp/test_tp_engine.py (which runs gloo on CPU in CI). Needs converted
tiny weights for tp 1 and 2 (`tilepd convert-weights --dtype fp32 --tp N`), made where the HF tooling is:

    python bench/tp_gpu_parity.py --weights DIR   # DIR/{llama,deepseek_v3}-tp{1,2}
Prints one line per family and case; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilepd.dev.synthetic import random_kv_state
from tilepd.engine import SamplingParams, load_engine
from tilepd.engine.tp_engine import launch_tp_engine

GREEDY = SamplingParams(ignore_eos=True)


def check(weights: Path, family: str, graph: bool, n: int) -> bool:
    ref = load_engine(weights / f"{family}-tp1", device="cuda:0", max_seq_len=256, dtype="float32", use_cuda_graph=graph, num_speculative_tokens=0)
    state = random_kv_state(ref.config, 33, seed=3)
    ref.inject(state)
    want = ref.decode(5, n, GREEDY, lambda t: None).tokens
    del ref
    torch.cuda.empty_cache()
    tp = launch_tp_engine(weights / f"{family}-tp2", 2, device="cuda", max_seq_len=256, dtype="float32", use_cuda_graph=graph, num_speculative_tokens=0)
    try:
        tp.inject(state)
        got = tp.decode(5, n, GREEDY, lambda t: None).tokens
        tp.inject(state)
        again = tp.decode(5, n, GREEDY, lambda t: None).tokens  # a second request on the same (captured) ranks
    finally:
        tp.close()
    ok = got == want == again and len(set(want)) > 3
    print(f"{family:12s} graph={graph!s:5s} 1 GPU {want[:12]}... 2 GPUs {'== (twice)' if ok else got[:12]} -> {'OK' if ok else 'MISMATCH'}",
          flush=True)
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--family", choices=["llama", "deepseek_v3"], action="append", help="default: both")
    ap.add_argument("--graph", choices=["off", "on"], action="append", help="default: both")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("needs 2 CUDA devices")
    families = args.family or ["llama", "deepseek_v3"]
    graphs = [g == "on" for g in (args.graph or ["off", "on"])]
    results = [check(args.weights, fam, graph, args.tokens) for fam in families for graph in graphs]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
