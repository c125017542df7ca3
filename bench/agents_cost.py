"""What logprobs and grammar-constrained decoding cost per token in the batch-1 engine, in one run.

On a GPU (the target: one NVIDIA H200):

    python bench/agents_cost.py                 # Llama-3-8B-shaped (vocab 128256), context 1024, 256 tokens
    python bench/agents_cost.py --json > agents.json
    python bench/agents_cost.py --device cpu --tiny   # the same code on a tiny shape (smoke test)

Random bf16 weights built on the device, no download. The grammar needs a vocabulary: a synthetic one of
the model's vocab size (xgrammar RAW vocab: the 256 single bytes, then ASCII words, JSON punctuation and
digits combined, deterministic), so the mask cost reflects a 128K vocabulary without a tokenizer file.
Rows (ms/token, greedy, ignore_eos): `plain` (the sampling-in-graph step every plain request runs),
`logprobs(20)` (the logits step + log_softmax + top-20), `json_schema` (the logits step + bitmask fill and
apply every token). `mask_us` is the bitmask fill + apply alone, timed on the tokens the constrained run
produced (a fresh matcher replaying them). The plain row is the overhead check: plain requests do not
touch the new path, so its ms/token is the engine's usual figure (compare bench/decode_speed.py `speed-path`).
"""

from __future__ import annotations

import argparse
import json
import string
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import CONFIGS, random_state, sync

from tilepd.dev.synthetic import random_runtime_weights
from tilepd.engine.engine import Engine, build_model
from tilepd.engine.grammar import Constraint, GrammarCompiler
from tilepd.model_format.model_spec import spec_from_hf_config
from tilepd.engine.types import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def synthetic_vocab(size: int) -> list[bytes]:
    """256 bytes, then deterministic ASCII pieces (words, JSON punctuation, digits, leading spaces)."""
    vocab = [bytes([i]) for i in range(256)]
    letters, punct = string.ascii_lowercase, ['"', ",", ":", "{", "}", "[", "]", '":', '",', " ", "\n"]
    gen = torch.Generator().manual_seed(0)
    seen = set(vocab)
    while len(vocab) < size:
        n = int(torch.randint(2, 9, (1,), generator=gen))
        word = "".join(letters[int(i)] for i in torch.randint(0, 26, (n,), generator=gen))
        kind = int(torch.randint(0, 6, (1,), generator=gen))
        piece = {0: " " + word, 1: word, 2: word + punct[int(torch.randint(0, len(punct), (1,), generator=gen))],
                 3: str(int(torch.randint(0, 10000, (1,), generator=gen))), 4: '"' + word, 5: word.capitalize()}[kind]
        b = piece.encode()
        if b not in seen:
            seen.add(b)
            vocab.append(b)
    return vocab[:size]


def first_allowed(grammar, vocab_size: int, device: torch.device) -> int:
    """The first token the grammar allows (what a constrained prefill would have sampled), accepted."""
    logits = torch.zeros(vocab_size, device=device)
    grammar.mask(logits)
    tok = int(torch.argmax(logits))
    assert grammar.accept(tok)
    return tok


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import xgrammar as xgr

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    context = args.context or (32 if args.tiny else 1024)
    tokens = args.tokens or (16 if args.tiny else 256)
    cfg = CONFIGS["llama3-8b"][1 if args.tiny else 0]
    spec = spec_from_hf_config(cfg)
    model = build_model(spec, random_runtime_weights(spec, device, dtype), context + tokens + 16, device, dtype)
    engine = Engine(model, spec, device, context + tokens + 16, use_cuda_graph=device.type == "cuda")
    eos = int(spec.eos_token_ids[0])
    info = xgr.TokenizerInfo(encoded_vocab=synthetic_vocab(spec.vocab_size), vocab_type=xgr.VocabType.RAW,
                             vocab_size=spec.vocab_size, stop_token_ids=[eos])
    compiler = GrammarCompiler(info, spec.vocab_size)
    t0 = time.perf_counter()
    compiled = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    compile_ms = (time.perf_counter() - t0) * 1e3
    state = random_state(spec, context, device, dtype)
    params = SamplingParams(ignore_eos=True)
    report: dict = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "vocab_size": spec.vocab_size, "context": context, "tokens": tokens, "compile_ms": compile_ms, "rows": {}}

    def run(name: str, **kw) -> list[int]:
        out: list[int] = []
        for timed in (False, True):  # the first run captures the graphs
            grammar = None
            if name == "json_schema":
                grammar = compiler.matcher(compiled, {eos})
                first = first_allowed(grammar, spec.vocab_size, device)
                kw["grammar"] = grammar
            engine.inject(state)
            sync(device)
            res = engine.decode(first if grammar is not None else 3, tokens if timed else 4, params, lambda t: None, **kw)
            if timed:
                n = max(len(res.tokens), 1)
                report["rows"][name] = {"ms_per_token": res.timings["decode_ms"] / n, "tokens": len(res.tokens), "finish": res.finish_reason}
                out = res.tokens
        return out

    run("plain")
    run("logprobs(20)", logprobs=20, on_logprobs=lambda lp: None)
    produced = run("json_schema")
    # the mask alone: a fresh matcher replays the constrained run's tokens
    g = compiler.matcher(compiled, {eos})
    first_allowed(g, spec.vocab_size, device)
    logits = torch.zeros(spec.vocab_size, device=device)
    times = []
    for tok in produced:
        sync(device)
        t = time.perf_counter()
        g.mask(logits)
        sync(device)
        times.append(time.perf_counter() - t)
        if not g.accept(tok):
            break
    report["mask_us"] = {"mean": 1e6 * sum(times) / max(len(times), 1), "max": 1e6 * max(times or [0.0]), "steps": len(times)}
    plain = report["rows"]["plain"]["ms_per_token"]
    for row in report["rows"].values():
        row["vs_plain"] = row["ms_per_token"] / plain - 1.0
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{report['gpu'] or report['device']}  vocab {spec.vocab_size}  context {context}  compile {compile_ms:.1f} ms")
        for name, row in report["rows"].items():
            print(f"  {name:14s} {row['ms_per_token']:8.3f} ms/token  ({row['vs_plain'] * 100:+.1f}% vs plain, {row['tokens']} tokens, {row['finish']})")
        m = report["mask_us"]
        print(f"  mask fill+apply: mean {m['mean']:.1f} us, max {m['max']:.1f} us per token over {m['steps']} steps")
    return report


if __name__ == "__main__":
    main()
