"""config.json values of a few published checkpoints, for when `hf_path` cannot be read where `validate` runs.

The memory-fit rule computes every figure (parameters, cache bytes) from these shapes exactly as it would
from the checkpoint's own config.json; nothing here is a parameter count. Keys are Hugging Face repo ids,
as `model.hf_id` names them. Each entry cites the config.json it copies (only the keys tilepd reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KnownModel:
    hf_id: str
    config: dict[str, Any]
    source: str


_FP8_BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

# huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (also DeepSeek-V3-0324, same shapes)
_DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "num_nextn_predict_layers": 1, "attention_bias": False, "torch_dtype": "bfloat16", "quantization_config": _FP8_BLOCK,
}

# huggingface.co/deepseek-ai/DeepSeek-V3.2/blob/main/config.json: DeepSeek-V3's shapes plus the lightning indexer
_DEEPSEEK_V32: dict[str, Any] = {**_DEEPSEEK_V3, "model_type": "deepseek_v32", "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}

# huggingface.co/zai-org/GLM-5.1/blob/main/config.json (bf16; 282 safetensors shards, 753,864,139,008 parameters
# with the MTP layer, 1404 GB)
_GLM51: dict[str, Any] = {
    "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192,
    "v_head_dim": 256, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "rope_interleave": True,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "attention_bias": False, "index_head_dim": 128, "index_n_heads": 32,
    "index_topk": 2048, "indexer_rope_interleave": True, "dtype": "bfloat16",
}

# huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json (and -Instruct)
_LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
}

# huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json (and -Instruct)
_LLAMA3_70B: dict[str, Any] = {**_LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64}

_MODELS: tuple[KnownModel, ...] = (
    KnownModel("zai-org/GLM-5.1", _GLM51, "huggingface.co/zai-org/GLM-5.1 config.json"),
    # The FP8 release: the same config plus block-scaled e4m3 weights (one fp32 scale per 128x128 block, the
    # DeepSeek format issue 11 describes); tilepd.model_format.model_spec accepts only this quantization.
    KnownModel("zai-org/GLM-5.1-FP8", {**_GLM51, "quantization_config": _FP8_BLOCK}, "huggingface.co/zai-org/GLM-5.1-FP8 config.json"),
    KnownModel("deepseek-ai/DeepSeek-V3.2", _DEEPSEEK_V32, "huggingface.co/deepseek-ai/DeepSeek-V3.2 config.json"),
    KnownModel("deepseek-ai/DeepSeek-V3", _DEEPSEEK_V3, "huggingface.co/deepseek-ai/DeepSeek-V3 config.json"),
    KnownModel("meta-llama/Meta-Llama-3-8B", _LLAMA3_8B, "huggingface.co/meta-llama/Meta-Llama-3-8B config.json"),
    KnownModel("meta-llama/Meta-Llama-3-8B-Instruct", _LLAMA3_8B, "huggingface.co/meta-llama/Meta-Llama-3-8B-Instruct config.json"),
    KnownModel("meta-llama/Meta-Llama-3-70B", _LLAMA3_70B, "huggingface.co/meta-llama/Meta-Llama-3-70B config.json"),
    KnownModel("meta-llama/Meta-Llama-3-70B-Instruct", _LLAMA3_70B, "huggingface.co/meta-llama/Meta-Llama-3-70B-Instruct config.json"),
)

KNOWN_MODELS: dict[str, KnownModel] = {m.hf_id: m for m in _MODELS}


def known_model(hf_id: str) -> KnownModel | None:
    """The bundled entry for a repo id (case-insensitive)."""
    for key, model in KNOWN_MODELS.items():
        if key.lower() == hf_id.lower():
            return model
    return None
