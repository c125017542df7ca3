"""Which tilepd runtime tensors a family has and how each is built from HF checkpoint tensors.

A conversion is a list of `OutTensor`s. Each names its HF source tensors (so missing ones are found
before anything is written) and how they combine: parts concatenated along dim 0 (fused QKV, gate-up),
optionally stacked along a new dim (MoE experts), optionally reshaped per head (MLA's W_UK/W_UV).
Tensor-parallel shards split each part before fusing, so every rank's fused tensor is [q_r; k_r; v_r].
"""

from __future__ import annotations

from dataclasses import dataclass

from tilepd.model_format.model_spec import ModelSpec

LAYOUT_VERSION = 2  # 2: the MoE router gate is stored in its source's float dtype (1 widened it to float32)


@dataclass(frozen=True)
class OutTensor:
    name: str
    groups: tuple[tuple[str, ...], ...]  # each group: parts concatenated along dim 0
    stacked: bool = False  # True: groups stacked along a new dim 0 (experts); else exactly one group
    shard_dim: int | None = None  # per-part split for tensor parallelism; None = replicated
    keep_fp32: bool = False  # stored float32 whatever the source (the router's correction bias, the DSA indexer's weights_proj)
    # Stored in the source's own float dtype, at least bf16 (source_float_dtype): a bf16 source stays bf16, anything else
    # is float32; its users upcast it to float32 where used (the router gate: HF computes F.linear(h.float(), w.float()),
    # so a bf16 gate gives the same logits from half the bytes a step reads).
    source_float: bool = False
    quantizable: bool = False  # a GEMV weight read through layers.linear: may be stored block-scaled fp8 (fp8_build.py)
    mla: str | None = None  # "uk" | "uv": split kv_b_proj per head into [H, nope, rank] / [H, v, rank]

    def __post_init__(self) -> None:
        if self.source_float and (len(self.sources) != 1 or self.keep_fp32 or self.quantizable or self.mla):
            raise ValueError(f"{self.name}: source_float is for one dense source tensor kept in its own dtype (not keep_fp32, quantizable or mla)")

    @property
    def sources(self) -> list[str]:
        return [p for g in self.groups for p in g]


def source_float_dtype(source: str, out_fp32: bool) -> str:
    """Stored dtype ("bfloat16" | "float32") of a `source_float` tensor whose source tensor is `source` (torch's dtype
    name: "bfloat16", "float32", "float16", "float8_e4m3fn"...). bf16 stays bf16 (never widened: half the bytes a step
    reads) unless the whole conversion is float32 (`out_fp32`); anything else is float32, which holds every such source
    exactly (fp16 or fp8 in bf16 would lose bits). Torch-free: the memory plan asks it with config.json's dtype."""
    return "bfloat16" if source == "bfloat16" and not out_fp32 else "float32"


def _one(name: str, src: str, **kw) -> OutTensor:
    return OutTensor(name, ((src,),), **kw)


def llama_layout(spec: ModelSpec, present: set[str]) -> list[OutTensor]:
    out = [_one("embed", "model.embed_tokens.weight", shard_dim=0), _one("norm", "model.norm.weight")]
    if not spec.tie_word_embeddings:
        out.append(_one("lm_head", "lm_head.weight", shard_dim=0, quantizable=False))
    for i in range(spec.num_layers):
        h, p = f"model.layers.{i}.", f"layers.{i}."
        a = h + "self_attn."
        out += [
            _one(p + "attn_norm", h + "input_layernorm.weight"),
            OutTensor(p + "wqkv", ((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),), shard_dim=0, quantizable=True),
            _one(p + "wo", a + "o_proj.weight", shard_dim=1, quantizable=True),
            _one(p + "mlp_norm", h + "post_attention_layernorm.weight"),
            OutTensor(p + "w13", ((h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),), shard_dim=0, quantizable=True),
            _one(p + "w2", h + "mlp.down_proj.weight", shard_dim=1, quantizable=True),
        ]
        if spec.qkv_bias or a + "q_proj.bias" in present:
            out.append(OutTensor(p + "bqkv", ((a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),), shard_dim=0))
        if spec.qk_norm:
            out += [_one(p + "q_norm", a + "q_norm.weight"), _one(p + "k_norm", a + "k_norm.weight")]
    return out


def _indexer(h: str, p: str) -> list[OutTensor]:
    """DSA lightning indexer of one layer (replicated under tensor parallelism, as in vLLM)."""
    i = h + "self_attn.indexer."
    return [
        _one(p + "idx_wq_b", i + "wq_b.weight", quantizable=True),
        _one(p + "idx_wk", i + "wk.weight", quantizable=True),
        _one(p + "idx_k_norm", i + "k_norm.weight"),
        _one(p + "idx_k_norm_bias", i + "k_norm.bias"),
        _one(p + "idx_weights_proj", i + "weights_proj.weight", keep_fp32=True),  # HF keeps it fp32 (_keep_in_fp32_modules)
    ]


def _mla_layer(spec: ModelSpec, h: str, p: str, moe: bool, indexer: bool = False) -> list[OutTensor]:
    a = h + "self_attn."
    out = _indexer(h, p) if indexer else []
    out += [
        _one(p + "attn_norm", h + "input_layernorm.weight"),
        _one(p + "wkv_a", a + "kv_a_proj_with_mqa.weight", quantizable=True),
        _one(p + "kv_a_norm", a + "kv_a_layernorm.weight"),
        _one(p + "w_uk", a + "kv_b_proj.weight", shard_dim=0, mla="uk"),
        _one(p + "w_uv", a + "kv_b_proj.weight", shard_dim=0, mla="uv"),
        _one(p + "wo", a + "o_proj.weight", shard_dim=1, quantizable=True),
        _one(p + "mlp_norm", h + "post_attention_layernorm.weight"),
    ]
    if spec.q_lora_rank:
        out += [
            _one(p + "wq_a", a + "q_a_proj.weight", quantizable=True),
            _one(p + "q_a_norm", a + "q_a_layernorm.weight"),
            _one(p + "wq_b", a + "q_b_proj.weight", shard_dim=0, quantizable=True),
        ]
    else:
        out.append(_one(p + "wq", a + "q_proj.weight", shard_dim=0, quantizable=True))
    m = h + "mlp."
    if not moe:
        return out + [
            OutTensor(p + "w13", ((m + "gate_proj.weight", m + "up_proj.weight"),), shard_dim=0, quantizable=True),
            _one(p + "w2", m + "down_proj.weight", shard_dim=1, quantizable=True),
        ]
    experts = range(spec.n_routed_experts)
    out += [
        _one(p + "gate", m + "gate.weight", source_float=True),  # bf16 in DeepSeek-V3.x / GLM-5.1; upcast where used (moe.py)
        _one(p + "gate_bias", m + "gate.e_score_correction_bias", keep_fp32=True),
        OutTensor(p + "experts_w13", tuple((f"{m}experts.{e}.gate_proj.weight", f"{m}experts.{e}.up_proj.weight") for e in experts),
                  stacked=True, shard_dim=0, quantizable=True),
        OutTensor(p + "experts_w2", tuple((f"{m}experts.{e}.down_proj.weight",) for e in experts), stacked=True, shard_dim=1, quantizable=True),
    ]
    if spec.n_shared_experts:
        s = m + "shared_experts."
        out += [
            OutTensor(p + "shared_w13", ((s + "gate_proj.weight", s + "up_proj.weight"),), shard_dim=0, quantizable=True),
            _one(p + "shared_w2", s + "down_proj.weight", shard_dim=1, quantizable=True),
        ]
    return out


def deepseek_layout(spec: ModelSpec, present: set[str]) -> list[OutTensor]:
    out = [
        _one("embed", "model.embed_tokens.weight", shard_dim=0),
        _one("norm", "model.norm.weight"),
        _one("lm_head", "lm_head.weight", shard_dim=0),
    ]
    for i in range(spec.num_layers):
        out += _mla_layer(spec, f"model.layers.{i}.", f"layers.{i}.", moe=i >= spec.first_k_dense_replace, indexer=spec.has_indexer(i))
    # MTP modules live at layer index num_layers + k in DeepSeek-V3 checkpoints. Their embedding and
    # output head are shared with the main model (the checkpoint repeats them), so they are not kept.
    for k in range(spec.num_mtp_layers):
        h, p = f"model.layers.{spec.num_layers + k}.", f"mtp.{k}."
        out += _mla_layer(spec, h, p, moe=True, indexer=spec.has_indexer(spec.num_layers + k))
        out += [
            _one(p + "enorm", h + "enorm.weight"),
            _one(p + "hnorm", h + "hnorm.weight"),
            _one(p + "eh_proj", h + "eh_proj.weight"),  # bf16 in DeepSeek-V3's fp8 checkpoint (vLLM: nn.Linear)
            _one(p + "head_norm", h + "shared_head.norm.weight"),
        ]
    return out


def family_layout(spec: ModelSpec, present: set[str]) -> list[OutTensor]:
    if spec.family == "llama":
        return llama_layout(spec, present)
    if spec.family == "deepseek_v3":
        return deepseek_layout(spec, present)
    raise ValueError(f"no weight layout for family {spec.family!r}")


def expected_shape(name: str, spec: ModelSpec) -> tuple[int, ...] | None:
    """Unsharded shape the engine expects for a runtime tensor (None: not a known name)."""
    s = spec
    h, v = s.hidden_size, s.vocab_size
    leaf = name.rsplit(".", 1)[-1]
    dense_i = s.intermediate_size
    mi, ns = s.moe_intermediate_size, s.n_shared_experts
    if s.family == "llama":
        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        table = {
            "wqkv": (qkv, h), "bqkv": (qkv,), "q_norm": (s.head_dim,), "k_norm": (s.head_dim,),
            "wo": (h, s.num_heads * s.head_dim), "w13": (2 * dense_i, h), "w2": (h, dense_i),
        }
    else:
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        table = {
            "wkv_a": (s.kv_lora_rank + s.qk_rope_head_dim, h), "kv_a_norm": (s.kv_lora_rank,),
            "w_uk": (s.num_heads, s.qk_nope_head_dim, s.kv_lora_rank), "w_uv": (s.num_heads, s.v_head_dim, s.kv_lora_rank),
            "wo": (h, s.num_heads * s.v_head_dim), "wq_a": (s.q_lora_rank or 0, h), "q_a_norm": (s.q_lora_rank or 0,),
            "wq_b": (s.num_heads * qk, s.q_lora_rank or 0), "wq": (s.num_heads * qk, h),
            "w13": (2 * dense_i, h), "w2": (h, dense_i), "gate": (s.n_routed_experts, h), "gate_bias": (s.n_routed_experts,),
            "experts_w13": (s.n_routed_experts, 2 * mi, h), "experts_w2": (s.n_routed_experts, h, mi),
            "shared_w13": (2 * mi * ns, h), "shared_w2": (h, mi * ns), "enorm": (h,), "hnorm": (h,), "head_norm": (h,),
            "eh_proj": (h, 2 * h),
            "idx_wq_b": (s.index_n_heads * s.index_head_dim, s.q_lora_rank or 0), "idx_wk": (s.index_head_dim, h),
            "idx_k_norm": (s.index_head_dim,), "idx_k_norm_bias": (s.index_head_dim,), "idx_weights_proj": (s.index_n_heads, h),
        }
    table.update({"embed": (v, h), "lm_head": (v, h), "norm": (h,), "attn_norm": (h,), "mlp_norm": (h,)})
    return table.get(leaf)
