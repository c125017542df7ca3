"""Llama-shaped HF checkpoints of any size with random weights, written streaming (benchmarks, converter tests).

Unlike tiny_model (which vLLM and HF load and which has a real tokenizer), this only needs to be a
valid checkpoint for convert-weights: config.json + sharded model-0000N.safetensors, never all in RAM.
"""

from __future__ import annotations

import json
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
