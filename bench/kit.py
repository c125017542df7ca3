"""What the benches share, in one place: the model shape table (gpt-fast's single table of configs), building a
model's random weights on the device, the HBM read floor, CUDA-graph timers and the report.

A bench script imports it as `from kit import ...`: bench/ is the running script's folder, hence sys.path[0]
(tests put bench/ on sys.path the same way). The script puts this checkout's tilepd first on sys.path before.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tilepd.dev.synthetic import random_runtime_weights
from tilepd.engine.types import KVState, SamplingParams
from tilepd.model_format.block_fp8 import BlockFp8
from tilepd.model_format.model_spec import ModelSpec, spec_from_hf_config

if TYPE_CHECKING:
    from tilepd.engine.engine import Engine

LLAMA3_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
DSV3_SMALL = {  # DeepSeek-V3 per-layer shapes; 2 layers (1 dense, 1 MoE) + 1 MTP layer to fit one GPU
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096},
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
# GLM-5.1's config.json (huggingface.co/zai-org/GLM-5.1, as tilepd/topology/known_models.py transcribes it; copied
# here so the GPU run needs no topology deps): per-layer shapes + the DSA indexer; 2 layers (1 dense, 1 MoE) + MTP.
GLM5_SMALL = {
    "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 2, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192,
    "v_head_dim": 256, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "rope_interleave": True,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "attention_bias": False, "index_head_dim": 128, "index_n_heads": 32,
    "index_topk": 2048, "indexer_rope_interleave": True, "bos_token_id": 0, "eos_token_id": 1,
}
# The served models at their real depth (tilepd/topology/known_models.py transcribes each config.json; copied here so
# the GPU run needs no topology deps): GLM-5.1 78 layers (3 dense, DSA), DeepSeek-V3 61 (3 dense), DeepSeek-V3.2 61
# (DeepSeek-V3's shapes plus the lightning indexer: 64 heads of 128, top-2048). The bench builds layers 0..3 and the
# MTP layer; layers 4.. alias layer 3 (deepen), so a full-depth step fits one GPU and still reads every layer from HBM.
GLM51 = {**GLM5_SMALL, "num_hidden_layers": 78, "first_k_dense_replace": 3}
DSV3 = {**DSV3_SMALL, "num_hidden_layers": 61, "first_k_dense_replace": 3}
DSV32 = {**DSV3, "model_type": "deepseek_v32", "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}
TINY_LLAMA = {**LLAMA3_8B, "bos_token_id": 0, "eos_token_id": 1, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}
TINY_DSV3 = {**DSV3_SMALL, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
             "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
             "topk_group": 2}
TINY_GLM5 = {**GLM5_SMALL, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
             "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16}
TINY_DEEP = {"num_hidden_layers": 6, "first_k_dense_replace": 2}  # tiny stand-ins of the deep models: 2 dense, 4 MoE (3 aliased)
CONFIGS = {"llama3-8b": (LLAMA3_8B, TINY_LLAMA), "dsv3-small": (DSV3_SMALL, TINY_DSV3), "glm5-small": (GLM5_SMALL, TINY_GLM5),
           "glm-5.1": (GLM51, {**TINY_GLM5, **TINY_DEEP}), "deepseek-v3": (DSV3, {**TINY_DSV3, **TINY_DEEP}),
           "deepseek-v3.2": (DSV32, {**TINY_DSV3, **TINY_DEEP, "model_type": "deepseek_v32", "index_head_dim": 32, "index_n_heads": 4,
                                     "index_topk": 16})}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def read_bandwidth(device: torch.device, gib: float) -> dict:
    """Best of several passes of a read-only reduction (sum) and a device-to-device copy over `gib` GiB."""
    n = int(gib * (1 << 30)) // 2
    x = torch.ones(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    out = {}
    for name, fn, factor in (("sum_read", lambda: x.sum(dtype=torch.float32), 1), ("copy_rw", lambda: y.copy_(x), 2)):
        fn()
        sync(device)
        best = float("inf")
        for _ in range(10 if device.type == "cuda" else 2):
            t0 = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - t0)
        out[name + "_GBps"] = factor * x.numel() * 2 / best / 1e9
    del x, y
    return out


def quantize_weights(spec: ModelSpec, weights: dict) -> None:
    """Replace every tensor `convert-weights --dtype fp8` would store as block-scaled fp8 (stores_fp8) by its
    e4m3 quantisation with 128x128 block scales, in place (stacked experts one at a time: bounded memory)."""
    from tilepd.model_format.block_fp8 import quantize
    from tilepd.weights.fp8_build import stores_fp8
    from tilepd.weights.out_tensors import family_layout

    for t in family_layout(spec, set()):
        if t.name not in weights or not stores_fp8(t, lambda p: False, True, False):
            continue
        w = weights[t.name]
        if t.stacked:
            parts = [quantize(w[e]) for e in range(w.shape[0])]
            weights[t.name] = BlockFp8(torch.stack([q.weight for q in parts]), torch.stack([q.scale for q in parts]), parts[0].block)
            del parts
        else:
            weights[t.name] = quantize(w)
        del w


def step_read_bytes(spec: ModelSpec, weights: dict, context: int) -> tuple[float, float]:
    """(weight bytes one decode step reads, KV bytes at `context`). Embedding: one row; MoE: the routed
    experts a token uses (num_experts_per_tok of n_routed_experts) plus everything else once; fp8 weights:
    values + block scales. DSA: per layer the min(index_topk, context) selected latent rows plus, for
    layers with their own indexer, the indexer keys of the whole context (what the step really reads); while the
    context fits index_topk every causal row is selected, so the indexer's query and head-weight projections and
    its keys are not needed (only the new key is computed and written)."""
    total = 0.0
    short = spec.is_dsa and context <= spec.index_topk
    for name, w in weights.items():
        b = w.nbytes() if isinstance(w, BlockFp8) else w.numel() * w.element_size()
        if short and name.endswith(("idx_wq_b", "idx_weights_proj")):
            continue
        if name == "embed":
            b = w.shape[1] * w.element_size()
        elif name.endswith(("experts_w13", "experts_w2")):
            b *= spec.num_experts_per_tok / spec.n_routed_experts
        elif name.startswith("mtp."):
            continue  # the plain decode step does not run the MTP layer
        total += b
    itemsize = weights["embed"].element_size()
    if spec.is_dsa:
        rows = min(spec.index_topk, context)
        kv = sum(rows * spec.cache_entry_width + (context * spec.index_head_dim if spec.has_indexer(i) and not short else 0)
                 for i in range(spec.num_layers))
        return total, float(kv * itemsize)
    kv = spec.num_layers * context * spec.cache_heads * spec.cache_entry_width * itemsize
    return total, float(kv)


def random_state(spec: ModelSpec, context: int, device: torch.device, dtype: torch.dtype) -> KVState:
    gen = torch.Generator(device=device).manual_seed(1)
    layers = [torch.randn(context, spec.cache_heads, spec.cache_entry_width, generator=gen, device=device, dtype=dtype) * 0.5
              for _ in range(spec.num_layers)]
    indexer = None
    if spec.is_dsa:
        indexer = [torch.randn(context, spec.index_head_dim, generator=gen, device=device, dtype=dtype) if spec.has_indexer(i) else None
                   for i in range(spec.num_layers)]
    return KVState(context, layers, indexer)


def time_engine(engine: Engine, spec: ModelSpec, context: int, tokens: int, device: torch.device, dtype: torch.dtype) -> tuple[float, list[int]]:
    """(ms/token, tokens) of a greedy decode after one warm-up decode (which captures the graphs)."""
    state = random_state(spec, context, device, dtype)
    params = SamplingParams(ignore_eos=True)
    for timed in (False, True):
        engine.inject(state)
        sync(device)
        res = engine.decode(3, tokens if timed else min(tokens, 8), params, lambda t: None)
        if timed:
            return res.timings["decode_ms"] / len(res.tokens), res.tokens
    raise AssertionError


def deepen(weights: dict, n: int, first: int = 1) -> None:
    """Layers first+1..n-1 alias layer `first`'s tensors (the first MoE layer; --layers): the real model's depth,
    hence its ratio of MTP draft to target cost, on one GPU. Each layer still reads its weights from HBM (a layer's
    hundreds of MB dwarf the L2) and has its own caches, so the step's time is a full-depth step's."""
    src = [name for name in weights if name.startswith(f"layers.{first}.")]
    for i in range(first + 1, n):
        for name in src:
            weights[f"layers.{i}." + name.removeprefix(f"layers.{first}.")] = weights[name]


def model_spec(model: str, tiny: bool, layers: int | None) -> tuple[dict, ModelSpec, ModelSpec]:
    """(config, spec of the model as run, spec of the part built): DeepSeek-family models run at `layers` (default:
    the config's depth; the -small shapes keep their 2) and are built up to their first MoE layer, the rest aliased."""
    cfg = CONFIGS[model][1 if tiny else 0]
    if layers is not None:
        if cfg["model_type"] == "llama":
            raise SystemExit(f"--layers is for the DeepSeek-family shapes ({', '.join(m for m in CONFIGS if m != 'llama3-8b')}), not {model}")
        if layers < 1:
            raise SystemExit(f"--layers {layers}: expected at least 1")
        cfg = {**cfg, "num_hidden_layers": layers}
    spec = spec_from_hf_config(cfg)
    if spec.family != "deepseek_v3":
        return cfg, spec, spec
    n_built = min(spec.num_layers, spec.first_k_dense_replace + 1)
    built = spec if n_built == spec.num_layers else spec_from_hf_config({**cfg, "num_hidden_layers": n_built})
    return cfg, spec, built


def build_weights(spec: ModelSpec, built: ModelSpec, device: torch.device, dtype: torch.dtype, fmt: str) -> dict:
    """Random weights of `built` (fp8: block-scaled as convert-weights stores them), deepened to spec's depth."""
    weights = random_runtime_weights(built, device, dtype)
    if fmt == "fp8":
        quantize_weights(built, weights)
    if built.num_layers < spec.num_layers:
        deepen(weights, spec.num_layers, first=built.num_layers - 1)
    return weights


def graph_time_us(fn, device: torch.device, reps: int = 20) -> float:
    """us per call of `fn`, as inside the decode step's CUDA graph: `reps` calls captured in one graph, best
    of 5 replays (no launch overhead). Without CUDA: a plain loop."""
    fn()
    sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        graph.replay()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del graph
    return best / reps * 1e6


def graph_replay_ms(fn, iters: int = 50, batches: int = 1) -> float:
    """ms per call of fn, replayed from one CUDA graph (launch overhead out of the comparison); with `batches`,
    the best batch of `iters` replays (another tenant's noise only slows one down)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters * 1e3)
    return best


def emit_report(report: dict, args: argparse.Namespace, print_table: Callable[[dict], None]) -> None:
    """A bench's report to `--out` (JSON file), and to stdout as JSON (`--json`) or as its table for people."""
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
