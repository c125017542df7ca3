"""DeepSeek-V3 variants against HF transformers: YaRN RoPE with mscale (the real checkpoints' setting),
no q_lora (q_proj), and non-interleaved RoPE."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tilepd.dev.hf_reference import engine_layout_state
from tilepd.engine import SamplingParams, load_engine

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=64, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
            topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            max_position_embeddings=2048, num_nextn_predict_layers=0, eos_token_id=1, bos_token_id=0)
YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}
VARIANTS = {
    "yarn": dict(rope_parameters=YARN),
    "no-q-lora": dict(q_lora_rank=None),
    "rope-not-interleaved": dict(rope_interleave=False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_deepseek_variant_matches_hf(variant: str, tmp_path: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(**{**BASE, **VARIANTS[variant]})
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5 * (1.0 if "embed" in name else 2.0))
            else:
                p.uniform_(0.8, 1.2)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(tmp_path)
    prompt = torch.randint(2, BASE["vocab_size"], (1, 70), generator=torch.Generator().manual_seed(1))  # past yarn's original length
    steps = 24
    with torch.no_grad():
        state = engine_layout_state(model(prompt, use_cache=True).past_key_values, "deepseek_v3", prompt.shape[1],
                                    rope_interleave=cfg.rope_interleave)
        out = model.generate(prompt, max_new_tokens=steps + 1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    ref = out.sequences[0, prompt.shape[1]:].tolist()
    engine = load_engine(tmp_path, device="cpu", max_seq_len=128, dtype="float32")
    engine.eager_step.logits_log = []
    engine.inject(state)
    res = engine.decode(ref[0], steps, SamplingParams(ignore_eos=True), lambda t: None)
    diffs = [float((a - b[0]).abs().max()) for a, b in zip(engine.eager_step.logits_log, out.logits[1:])]
    print(f"{variant}: max |logit diff| {max(diffs):.2e}, {len(set(ref))} distinct tokens")
    assert res.tokens == ref[1:]
    assert max(diffs) < 1e-4
