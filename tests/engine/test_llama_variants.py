"""Qwen2 (qkv bias, tied embeddings), Qwen3 (QK-norm), Mistral and Llama-3 RoPE scaling match HF transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tilepd.engine import SamplingParams, load_engine

from tilepd.dev.hf_reference import engine_layout_state

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1, bos_token_id=0)
VARIANTS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_hf(variant: str, tmp_path: Path) -> None:
    import transformers

    cfg_name, model_name, extra = VARIANTS[variant]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**COMMON, **extra)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # larger weights than HF's 0.02 init so greedy output is not one repeated token
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[-1] ** -0.5 * (2.0 if "embed" not in name else 1.0))
            elif "bias" in name:
                p.normal_(0, 0.5)
            else:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(tmp_path)
    prompt = torch.randint(2, COMMON["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    steps = 32
    with torch.no_grad():
        state = engine_layout_state(model(prompt, use_cache=True).past_key_values, "llama", prompt.shape[1])
        out = model.generate(prompt, max_new_tokens=steps + 1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    ref = out.sequences[0, prompt.shape[1]:].tolist()
    engine = load_engine(tmp_path, device="cpu", max_seq_len=128, dtype="float32")
    assert engine.config.model_type == cfg.model_type
    engine.eager_step.logits_log = []
    engine.inject(state)
    res = engine.decode(ref[0], steps, SamplingParams(ignore_eos=True), lambda t: None)
    diffs = [float((a - b[0]).abs().max()) for a, b in zip(engine.eager_step.logits_log, out.logits[1:])]
    print(f"{variant}: max |logit diff| {max(diffs):.2e}, {len(set(ref))} distinct tokens")
    assert res.tokens == ref[1:]
    assert max(diffs) < 1e-4
