"""KV handoff bench: stock vLLM (CPU) + TilePDConnector -> tilepd decode node, side by side.

For each prompt length (default 1K / 8K / 32K tokens, tiny llama with a long context):

- end of prefill -> first decoded token, split into extract (the connector's copies in
  the forward window, summed over the request's prefill steps; with chunked prefill each
  step copies the blocks it completed, `extract_final_ms` is the final step's share), wire (transport write), convert and
  inject (decode node), and the first decode step;
- the connector's overhead on a prefill step: the same prompts on a vLLM *with* the
  connector (marked, so the copy really happens) and one *without* it, interleaved
  in one run, medians compared (target: < 5 %); every timed request is a prompt
  neither instance has seen, so it is a full (chunked) prefill, not a prefix-cache hit;
- wire time vs the transport's raw bandwidth measured in the same run
  (`tilepd.transport.bench.raw_bandwidth`, same byte count; target: >= 70 % at 32K).

    .venv/bin/python bench/handoff.py [--transport tcp|nixl] [--lengths 1024,8192,32768] [--reps 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tilepd (and tests) first

from tests.handoff.stack import (
    complete,
    connector_config,
    decode,
    decode_config,
    events,
    marker,
    prompt_ids,
    start_decode,
    start_prefill,
)
from tilepd.connector.launch import Server, kv_transfer_config

REPO = Path(__file__).resolve().parents[1]


def _long_context_llama(work: Path, max_len: int) -> Path:
    from tilepd.dev.tiny_model import make_tiny_model

    md = make_tiny_model("llama", work / "tiny-llama-long")
    cfg = json.loads((md / "config.json").read_text())
    cfg["max_position_embeddings"] = max_len
    (md / "config.json").write_text(json.dumps(cfg, indent=1))
    return md


def _wait_sent(vllm: Server, tid: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(vllm):
            if e.get("transfer_id") == tid and e.get("event") in ("sent", "failed"):
                staged = next(x for x in events(vllm) if x.get("transfer_id") == tid and x.get("event") == "staged")
                return {**e, "staged_extract_ms": float(staged["extract_ms"]),
                        "staged_extract_total_ms": float(staged.get("extract_total_ms", staged["extract_ms"])),
                        "staged_chunks": int(staged.get("chunks", 1))}
        time.sleep(0.05)
    raise RuntimeError(f"no sent event for {tid}")


def _timed(fn, *a, **kw) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*a, **kw)
    return (time.perf_counter() - t) * 1e3, out


def run(transport: str, lengths: list[int], reps: int, work: Path) -> dict[str, Any]:
    from tilepd.transport.bench import raw_bandwidth

    max_len = max(lengths) + 256
    md = _long_context_llama(work, max_len)
    model = str(md)
    node = start_decode(decode_config("bench-decode", "llama", md, transport, work, max_seq_len=max_len, kv_timeout_s=120), work)
    servers: list[Server] = [node.server]
    try:
        extra = connector_config("llama", [node.endpoint], transport, max_seq_len=max_len)
        common = dict(max_model_len=max_len, batched_tokens=8192)
        started: dict[str, Server] = {}

        def start(name: str, kv: dict | None) -> None:
            started[name] = start_prefill(md, work / f"vllm-{name}.log", kv, **common)

        ts = [threading.Thread(target=start, args=("with", kv_transfer_config(extra))),
              threading.Thread(target=start, args=("without", None))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        servers += list(started.values())
        if set(started) != {"with", "without"}:
            raise RuntimeError("a vLLM instance did not start; see the logs in " + str(work))
        with_c, without_c = started["with"], started["without"]

        rows = []
        for n in lengths:
            warm = prompt_ids(n, seed=n)
            complete(with_c, model, warm, 1)  # warm-up both instances at this length
            complete(without_c, model, warm, 1)
            plain, marked, handoffs = [], [], []
            for r in range(reps):
                # a prompt neither instance has seen: vLLM's prefix cache would otherwise skip
                # the prefill (a repeat computes one block) and the bench would time no prefill at all
                ids = prompt_ids(n, seed=n * 1000 + r + 1)
                tid = f"bench-{n}-{r}"
                ms_plain, _ = _timed(complete, without_c, model, ids, 1)
                ms_marked, (first, _) = _timed(complete, with_c, model, ids, 1, marker(node, tid))
                t_end_prefill = time.perf_counter()
                resp = decode(node, tid, first[0], n, 1, kv_timeout_s=120)
                t_first = time.perf_counter()
                if resp.status_code != 200:
                    raise RuntimeError(f"decode {tid}: {resp.status_code} {resp.text}")
                sent = _wait_sent(with_c, tid)
                dt = resp.json()["timings"]
                plain.append(ms_plain)
                marked.append(ms_marked)
                handoffs.append({
                    "to_first_token_ms": (t_first - t_end_prefill) * 1e3,
                    "extract_ms": sent["staged_extract_total_ms"], "extract_final_ms": sent["staged_extract_ms"],
                    "chunks": sent["staged_chunks"], "wire_ms": float(sent.get("wire_ms", "nan")),
                    "queued_ms": float(sent.get("queued_ms", "nan")), "kv_wait_ms": dt.get("wait_ms"),
                    "convert_ms": dt.get("convert_ms"), "inject_ms": dt.get("inject_ms"), "decode_ms": dt.get("decode_ms"),
                    "bytes": int(sent.get("bytes", 0)),
                })
            med = {k: statistics.median(h[k] for h in handoffs) for k in handoffs[0]}
            med["bytes"] = int(med["bytes"])
            raw = raw_bandwidth(transport, med["bytes"], repeats=3)
            wire_gbps = med["bytes"] / (med["wire_ms"] / 1e3) / 1e9
            rows.append({
                "prompt_tokens": n, "bytes": med["bytes"], "handoff_median": med,
                "prefill_ms_without": statistics.median(plain), "prefill_ms_with": statistics.median(marked),
                "prefill_overhead": statistics.median(marked) / statistics.median(plain) - 1.0,
                "extract_share_of_prefill": med["extract_ms"] / statistics.median(marked),
                "wire_gbps": wire_gbps, "raw_gbps": raw["median_gbps"], "raw_best_gbps": raw["best_gbps"],
                "wire_vs_raw": wire_gbps / raw["median_gbps"], "raw_checksum_ok": raw["checksum_ok"],
                "runs": {"prefill_without_ms": plain, "prefill_with_ms": marked, "handoffs": handoffs},
            })
        return {"transport": transport, "reps": reps, "machine": _machine(), "rows": rows}
    finally:
        for s in reversed(servers):
            s.stop()


def _machine() -> str:
    import os

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()} {platform.release()}"


def _print(res: dict[str, Any]) -> None:
    print(f"\nKV handoff, transport={res['transport']}, reps={res['reps']} (medians); {res['machine']}")
    hdr = (f"{'tokens':>7} {'KV MiB':>7} | {'prefill w/o':>11} {'prefill w/':>10} {'overhead':>8} {'copy/step':>9} | "
           f"{'extract':>7} {'final':>7} {'steps':>5} {'wire':>7} {'convert':>7} {'inject':>7} {'decode1':>7} {'end->1st':>8} | "
           f"{'wire GB/s':>9} {'raw GB/s':>8} {'wire/raw':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in res["rows"]:
        h = r["handoff_median"]
        print(f"{r['prompt_tokens']:>7} {r['bytes'] / 2**20:>7.1f} | {r['prefill_ms_without']:>9.1f}ms {r['prefill_ms_with']:>8.1f}ms "
              f"{r['prefill_overhead']:>+8.1%} {r['extract_share_of_prefill']:>9.2%} | {h['extract_ms']:>5.2f}ms {h['extract_final_ms']:>5.2f}ms {h['chunks']:>5.0f} {h['wire_ms']:>5.2f}ms "
              f"{h['convert_ms']:>5.2f}ms {h['inject_ms']:>5.2f}ms {h['decode_ms']:>5.2f}ms {h['to_first_token_ms']:>6.1f}ms | "
              f"{r['wire_gbps']:>9.2f} {r['raw_gbps']:>8.2f} {r['wire_vs_raw']:>8.1%}")
    last = res["rows"][-1]
    print(f"\nratios: prefill overhead at {last['prompt_tokens']} tokens {last['prefill_overhead']:+.1%} (target < 5%), "
          f"copy time (all steps) {last['extract_share_of_prefill']:.2%} of the prefill; wire/raw {last['wire_vs_raw']:.0%} (target >= 70%)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="tcp", choices=["tcp", "nixl"])
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--workdir", type=Path, default=None, help="keep models and logs here (default: a temp dir)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        res = run(args.transport, lengths, args.reps, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="tilepd-bench-handoff-") as d:
            res = run(args.transport, lengths, args.reps, Path(d))
    _print(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
