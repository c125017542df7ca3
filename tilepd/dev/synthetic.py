"""Llama-shaped HF checkpoints of any size with random weights, written streaming (benchmarks, converter tests).

Unlike tiny_model (which vLLM and HF load and which has a real tokenizer), this only needs to be a
valid checkpoint for convert-weights: config.json + sharded model-0000N.safetensors, never all in RAM.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from tilepd.weights.safetensors_writer import StreamingSafetensorsWriter


def llama_tensor_shapes(hidden: int, layers: int, intermediate: int, vocab: int, heads: int, kv_heads: int) -> list[tuple[str, tuple[int, ...]]]:
    hd = hidden // heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (heads * hd, hidden)),
            (p + "self_attn.k_proj.weight", (kv_heads * hd, hidden)),
            (p + "self_attn.v_proj.weight", (kv_heads * hd, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, heads * hd)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (intermediate, hidden)),
            (p + "mlp.up_proj.weight", (intermediate, hidden)),
            (p + "mlp.down_proj.weight", (hidden, intermediate)),
        ]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def make_synthetic_llama(out_dir: Path, *, hidden: int = 1024, layers: int = 4, intermediate: int = 4096, vocab: int = 32000,
                         heads: int = 16, kv_heads: int = 4, dtype: torch.dtype = torch.float32, shard_bytes: int = 1 << 30,
                         seed: int = 0) -> Path:
    """Write the checkpoint into out_dir (shards of about shard_bytes) and return out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shapes = llama_tensor_shapes(hidden, layers, intermediate, vocab, heads, kv_heads)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        n = dtype.itemsize
        for d in shape:
            n *= d
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    gen = torch.Generator().manual_seed(seed)
    for k, shard in enumerate(shards):
        path = out_dir / f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = StreamingSafetensorsWriter(path, [(n, dtype, s) for n, s in shard], metadata={"format": "pt"})
        for name, shape in shard:
            t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * (shape[-1] ** -0.5)
            writer.write(name, t.to(dtype))
            del t
        writer.close()
    return out_dir


def hf_tensor_shapes(spec) -> dict[str, tuple[int, ...]]:
    """HF checkpoint tensor names and shapes a ModelSpec implies (llama or deepseek_v3, incl. MTP layers)."""
    from tilepd.weights.out_tensors import family_layout

    s = spec
    h = s.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for t in family_layout(s, set()):
        for name in t.sources:
            shapes[name] = _hf_shape(name, s, h)
    return shapes


def _hf_shape(name: str, s, h: int) -> tuple[int, ...]:
    leaf = name.removesuffix(".weight").removesuffix(".bias")
    is_bias = name.endswith(".bias")
    last = leaf.rsplit(".", 1)[-1]
    if last in ("embed_tokens", "lm_head", "head"):
        return (s.vocab_size, h)
    if last in ("input_layernorm", "post_attention_layernorm", "norm", "enorm", "hnorm"):
        return (h,)
    if s.family == "llama":
        hd, nh, nkv = s.head_dim, s.num_heads, s.num_kv_heads
        rows = {"q_proj": nh * hd, "k_proj": nkv * hd, "v_proj": nkv * hd}
        if last in rows:
            return (rows[last],) if is_bias else (rows[last], h)
        table = {"o_proj": (h, nh * hd), "gate_proj": (s.intermediate_size, h), "up_proj": (s.intermediate_size, h),
                 "down_proj": (h, s.intermediate_size), "q_norm": (hd,), "k_norm": (hd,)}
        return table[last]
    qk = s.qk_nope_head_dim + s.qk_rope_head_dim
    expert = ".experts." in name or ".shared_experts." in name
    inter = s.moe_intermediate_size * (s.n_shared_experts if ".shared_experts." in name else 1) if expert else s.intermediate_size
    table = {
        "q_a_proj": (s.q_lora_rank or 0, h), "q_a_layernorm": (s.q_lora_rank or 0,), "q_b_proj": (s.num_heads * qk, s.q_lora_rank or 0),
        "q_proj": (s.num_heads * qk, h), "kv_a_proj_with_mqa": (s.kv_lora_rank + s.qk_rope_head_dim, h),
        "kv_a_layernorm": (s.kv_lora_rank,), "kv_b_proj": (s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
        "o_proj": (h, s.num_heads * s.v_head_dim), "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter),
        "gate": (s.n_routed_experts, h), "e_score_correction_bias": (s.n_routed_experts,), "eh_proj": (h, 2 * h),
        # DSA lightning indexer (self_attn.indexer.*)
        "wq_b": (s.index_n_heads * s.index_head_dim, s.q_lora_rank or 0), "wk": (s.index_head_dim, h),
        "k_norm": (s.index_head_dim,), "weights_proj": (s.index_n_heads, h),
    }
    if name.endswith("e_score_correction_bias"):
        return table["e_score_correction_bias"]
    return table[last]


def random_source(shapes: dict[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype, seed: int = 0) -> Callable[[str], torch.Tensor]:
    """HF source tensor name -> random values of the scale real weights have, each from its own seeded generator, so
    a tensor read twice (kv_b_proj feeds W_UK and W_UV) is the same both times."""
    import zlib

    def get(name: str) -> torch.Tensor:
        shape = shapes[name]
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("e_score_correction_bias"):
            return torch.randn(shape, generator=gen, device=device) * 0.01
        if len(shape) == 1:
            return torch.ones(shape, device=device, dtype=dtype)
        std = 1.0 if "embed_tokens" in name else shape[-1] ** -0.5
        return torch.randn(shape, generator=gen, device=device, dtype=dtype) * std

    return get


def random_runtime_weights(spec, device: torch.device, dtype: torch.dtype, seed: int = 0, rank: int = 0, tp: int = 1) -> dict[str, torch.Tensor]:
    """tilepd runtime weights with random values, built directly on `device` (no checkpoint, no disk);
    with tp > 1 only tensor-parallel rank `rank`'s shard is kept (as `convert-weights --tp` writes it).

    Each HF-named source tensor is drawn by random_source, and only one layer's sources exist at a time."""
    from tilepd.weights.build import build_chunks, cast_chunk
    from tilepd.weights.out_tensors import family_layout

    get = random_source(hf_tensor_shapes(spec), device, dtype, seed)

    out: dict[str, torch.Tensor] = {}
    for t in family_layout(spec, set()):
        chunks = [cast_chunk(t, c, dtype, False)[0] for c in build_chunks(t, get, spec, rank, tp)]
        out[t.name] = torch.stack(chunks) if t.stacked else chunks[0]
        del chunks
    return out


def random_kv_state(spec, seq_len: int, num_layers: int | None = None, seed: int = 0):
    """A prefix in the engine layout (INTERFACES §1) with values of the scale real caches have."""
    from tilepd.engine.types import KVState

    g = torch.Generator().manual_seed(seed)
    shape = (seq_len, spec.cache_heads, spec.cache_entry_width)
    return KVState(seq_len, [torch.randn(*shape, generator=g) for _ in range(num_layers or spec.num_layers)])
