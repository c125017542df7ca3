"""ModelSpec: the one config object every engine piece reads (built from an HF config.json dict)."""

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
    cache_dtype: str = "float32"  # set by the loader: the dtype of the static cache and of KVState tensors
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def cache_entry_width(self) -> int:
        """Channels per token per head of the native cache (INTERFACES §1)."""
        if self.family == "deepseek_v3":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.head_dim

    @property
    def cache_heads(self) -> int:
        return 1 if self.family == "deepseek_v3" else self.num_kv_heads

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


def spec_from_hf_config(cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelSpec:
    """Map an HF config.json (+ generation_config.json) to a ModelSpec; unknown model types are refused."""
    model_type = cfg.get("model_type", "")
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(FAMILY_OF_MODEL_TYPE))})")
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
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError("deepseek_v3 family: only topk_method 'noaux_tc' with sigmoid scoring is supported")
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
    )


def spec_from_model_dir(model_dir: Path) -> ModelSpec:
    """Read config.json (+ generation_config.json when present) of an HF checkpoint directory."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return spec_from_hf_config(cfg, gen)
