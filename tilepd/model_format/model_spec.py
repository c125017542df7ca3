"""ModelSpec: the one config object every engine piece reads (built from an HF config.json dict).

Torch-free: `validate`, `convert-weights` and the loader all call `spec_from_hf_config`, so a checkpoint
whose math the engine does not implement is refused in one place (UnsupportedModelError, naming the
config key), never decoded as a different model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# HF model_type -> tilepd family. Qwen2/3 and Mistral share the Llama decoder.
FAMILY_OF_MODEL_TYPE: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v32": "deepseek_v3",
    "glm_moe_dsa": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
}


# DSA (DeepSeek Sparse Attention) model types: MLA whose attention reads only the lightning indexer's top-k.
DSA_MODEL_TYPES: frozenset[str] = frozenset({"deepseek_v32", "glm_moe_dsa"})
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")  # what tilepd.engine.rope implements
# Config keys of related architectures (GLM-5 successors, DeepSeek-V4 style) that change the math and that
# the engine does not implement: present with a truthy value, the checkpoint is refused by name.
UNIMPLEMENTED_KEYS: tuple[str, ...] = ("index_kpool", "index_kpool_compress", "mhc", "hc_mult", "mla_use_nope", "swiglu_limit",
                                       "compress_ratios")


class UnsupportedModelError(ValueError):
    """A config feature that changes the model's math and that the engine does not implement."""


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and hyper-parameters of one model; cache geometry is read from here by the runtime."""

    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    qkv_bias: bool = False  # Qwen2: bias on q, k, v projections
    # deepseek_v3 (MLA + MoE + MTP)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    num_mtp_layers: int = 0
    rope_interleave: bool = True
    # DSA (deepseek_v32, glm_moe_dsa): the lightning indexer. index_topk 0 = dense MLA.
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_rope_interleave: bool = False  # vLLM's key: GPT-J pairs (True) or NeoX half-split (False)
    indexer_types: tuple[str, ...] = ()  # per main layer: "full" (own indexer) or "shared" (previous full layer's top-k)
    cache_dtype: str = "float32"  # set by the loader: the dtype of the static cache and of KVState tensors
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def cache_entry_width(self) -> int:
        """Channels per token per head of the cache in the engine layout (INTERFACES §1)."""
        if self.family == "deepseek_v3":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.head_dim

    @property
    def cache_heads(self) -> int:
        return 1 if self.family == "deepseek_v3" else self.num_kv_heads

    @property
    def is_dsa(self) -> bool:
        return self.index_topk > 0

    def has_indexer(self, layer: int) -> bool:
        """Whether layer `layer` (main layers, then MTP layers) runs its own indexer and keeps indexer keys.
        MTP layers always do (vLLM deepseek_v2.py:1157-1166: "MTP/nextn layers always build a full indexer")."""
        if not self.is_dsa:
            return False
        return layer >= self.num_layers or self.indexer_types[layer] == "full"

    def with_cache_dtype(self, dtype: str) -> "ModelSpec":
        return replace(self, cache_dtype=dtype)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d


def _eos_ids(cfg: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (cfg.get("eos_token_id"), (generation or {}).get("eos_token_id")):
        if source is None:
            continue
        for i in source if isinstance(source, list) else [source]:
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def _refuse(key: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config {key}={value!r}: {why}")


def _check_common(cfg: dict[str, Any], family: str) -> None:
    """Features of either family that change the math and are not implemented."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if kind not in (*ROPE_TYPES, None):
        raise _refuse("rope_parameters.rope_type" if cfg.get("rope_parameters") else "rope_scaling.rope_type", kind,
                      f"RoPE type not implemented by the engine (implemented: {', '.join(ROPE_TYPES)})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "the engine's MLPs are SwiGLU (silu) only")
    if cfg.get("mlp_bias"):
        raise _refuse("mlp_bias", cfg["mlp_bias"], "MLP projections with bias are not implemented")
    for key in UNIMPLEMENTED_KEYS:
        if cfg.get(key):
            raise _refuse(key, cfg[key], "this architecture feature is not implemented by the engine")
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) and int(window) < int(cfg.get("max_position_embeddings", 4096)):
        raise _refuse("sliding_window", window, "sliding-window attention is not implemented (the engine attends to the whole prefix)")
    _check_quantization(cfg.get("quantization_config"))


def _check_quantization(q: Any) -> None:
    """Only block-scaled fp8 checkpoints (DeepSeek / GLM style: e4m3, one scale per 128x128 block) load."""
    if not q:
        return
    if not isinstance(q, dict):
        raise _refuse("quantization_config", q, "expected an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise _refuse("quantization_config.quant_method", method,
                      "only block-scaled fp8 ('fp8', weight_block_size [128, 128]) checkpoints are supported")
    block = q.get("weight_block_size")
    if list(block or []) != [128, 128]:
        raise _refuse("quantization_config.weight_block_size", block, "only fp8 with one scale per [128, 128] block is supported")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("quantization_config.fmt", fmt, "only float8 e4m3 weights are supported")


def _indexer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    """Per-layer "full"/"shared" as vLLM builds them (deepseek_v2.py:1140-1154: index_topk_pattern, else
    index_topk_freq/index_skip_topk_offset), cross-checked with HF's `indexer_types` when the config has it
    (configuration_glm_moe_dsa.py __post_init__ derives the same schedule)."""
    pattern = cfg.get("index_topk_pattern")
    freq = int(cfg.get("index_topk_freq") or 1)
    offset = int(cfg.get("index_skip_topk_offset", 2) if cfg.get("index_skip_topk_offset") is not None else 2)
    if pattern is not None:
        names = {"F": "full", "S": "shared", "full": "full", "shared": "shared"}
        items = list(pattern)
        bad = [x for x in items if x not in names]
        if bad or len(items) < n:
            raise _refuse("index_topk_pattern", pattern, f"expected one of F/S (or full/shared) for each of the {n} layers")
        vllm = tuple(names[x] for x in items[:n])
    else:
        if freq < 1:
            raise _refuse("index_topk_freq", cfg.get("index_topk_freq"), "must be >= 1")
        vllm = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n))
    hf = cfg.get("indexer_types")
    if hf is not None:
        unknown = sorted({str(x) for x in hf} - {"full", "shared"})
        if unknown:
            raise _refuse("indexer_types", unknown, "indexer type not implemented (implemented: full, shared)")
        if tuple(hf[:n]) != vllm:
            raise _refuse("indexer_types", hf, f"differs from the schedule vLLM's prefill uses ({list(vllm)}, from "
                          "index_topk_pattern / index_topk_freq / index_skip_topk_offset); the two would run different models")
    if vllm and vllm[0] != "full":
        raise _refuse("index_topk_pattern", pattern, "the first layer must run its own indexer (a shared layer reuses a previous one)")
    return vllm


def _dsa_fields(cfg: dict[str, Any], model_type: str, n: int) -> dict[str, Any]:
    if model_type not in DSA_MODEL_TYPES:
        if cfg.get("index_topk"):
            raise _refuse("index_topk", cfg["index_topk"], f"sparse attention for model_type {model_type!r} is not implemented "
                          f"(DSA is implemented for {', '.join(sorted(DSA_MODEL_TYPES))})")
        return {}
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise _refuse(key, cfg.get(key), f"{model_type} needs a positive integer")
    if not cfg.get("q_lora_rank"):
        raise _refuse("q_lora_rank", cfg.get("q_lora_rank"), "the DSA indexer reads the q_lora latent; a DSA model needs q_lora_rank")
    if cfg["index_head_dim"] < int(cfg["qk_rope_head_dim"]):
        raise _refuse("index_head_dim", cfg["index_head_dim"], "smaller than qk_rope_head_dim (the indexer ropes its first qk_rope_head_dim dims)")
    # HF defines the indexer's RoPE per model (modeling_glm_moe_dsa.py:220-221 interleaved; modeling_deepseek_v32.py:219-220
    # half-split); vLLM's prefill follows the config key (deepseek_v2.py:1177, default False). They must agree.
    interleave = bool(cfg.get("indexer_rope_interleave", False))
    want = model_type == "glm_moe_dsa"
    if interleave != want:
        raise _refuse("indexer_rope_interleave", cfg.get("indexer_rope_interleave"),
                      f"{model_type}'s indexer is defined with {'interleaved' if want else 'half-split (NeoX)'} RoPE (transformers), "
                      f"but vLLM's prefill would write {'interleaved' if interleave else 'half-split'} keys; set it to {str(want).lower()}")
    if cfg.get("rope_interleave") is False:
        raise _refuse("rope_interleave", False, f"{model_type}'s MLA RoPE is interleaved in transformers; a half-split variant is not defined")
    return dict(index_topk=int(cfg["index_topk"]), index_n_heads=int(cfg["index_n_heads"]), index_head_dim=int(cfg["index_head_dim"]),
                indexer_rope_interleave=interleave, indexer_types=_indexer_types(cfg, n))


def spec_from_hf_config(cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelSpec:
    """Map an HF config.json (+ generation_config.json) to a ModelSpec.

    Raises UnsupportedModelError (a ValueError) naming the config key of any feature that changes the math
    and that the engine does not implement: the model is refused rather than decoded as a different one."""
    model_type = cfg.get("model_type", "")
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if family is None:
        raise _refuse("model_type", model_type, f"not supported (supported: {', '.join(sorted(FAMILY_OF_MODEL_TYPE))})")
    _check_common(cfg, family)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) not in ("default", None) else None
    heads = int(cfg["num_attention_heads"])
    common = dict(
        family=family,
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(cfg, generation),
        bos_token_id=cfg.get("bos_token_id"),
    )
    if family == "llama":
        return ModelSpec(
            **common,
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            qk_norm=model_type == "qwen3",
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        )
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if cfg.get(key, want) != want:
            raise _refuse(key, cfg[key], f"MoE routing not implemented (the engine implements {key}={want!r})")
    if cfg.get("attention_bias"):
        raise _refuse("attention_bias", cfg["attention_bias"], "MLA projections with bias are not implemented")
    if cfg.get("n_routed_experts") and int(cfg.get("moe_layer_freq") or 1) != 1:
        raise _refuse("moe_layer_freq", cfg["moe_layer_freq"], "only every layer after first_k_dense_replace being MoE is implemented")
    num_layers = int(cfg["num_hidden_layers"])
    return ModelSpec(
        **common,
        head_dim=int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]),
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        n_routed_experts=int(cfg["n_routed_experts"]),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers", 0)),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        **_dsa_fields(cfg, model_type, num_layers),
    )


def spec_from_model_dir(model_dir: Path) -> ModelSpec:
    """Read config.json (+ generation_config.json when present) of an HF checkpoint directory."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return spec_from_hf_config(cfg, gen)
