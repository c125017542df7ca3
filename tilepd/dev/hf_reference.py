"""HF transformers as a reference for the engine: prefix KV in tilepd's native layout, greedy tokens and per-step logits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tilepd.engine import KVState

PROMPT = "Once upon a time there was a little engine that"


@dataclass
class Reference:
    prompt_ids: list[int]
    state: KVState
    tokens: list[int]  # tokens[0] = the token sampled at the end of prefill ("first_token")
    logits: list[torch.Tensor]  # logits[i] produced tokens[i]


def _interleave(k_rot: torch.Tensor) -> torch.Tensor:
    """HF's DeepSeek rope returns [even-rotated | odd-rotated]; vLLM's MLA cache keeps pairs interleaved."""
    half = k_rot.shape[-1] // 2
    out = torch.empty_like(k_rot)
    out[..., 0::2] = k_rot[..., :half]
    out[..., 1::2] = k_rot[..., half:]
    return out


def native_state(past, family: str, seq_len: int, rope_interleave: bool = True) -> KVState:
    """HF cache -> KVState in the engine's native layout (DeepSeek k_pe re-interleaved when the model's
    RoPE is interleaved, as vLLM stores it)."""
    layers = []
    for layer in past.layers:
        k, v = layer.keys[0], layer.values[0]  # [H, T, D]
        if family == "llama":
            layers.append(torch.cat([k, v], dim=-1).permute(1, 0, 2).contiguous())
        else:  # keys = normalised latent [1, T, r]; values = roped k_pe [1, T, rope]
            layers.append(torch.cat([k, _interleave(v) if rope_interleave else v], dim=-1).permute(1, 0, 2).contiguous())
    return KVState(seq_len=seq_len, layers=layers)


def hf_reference(model_dir: Path, family: str, new_tokens: int, prompt: str = PROMPT) -> Reference:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        pre = model(ids, use_cache=True)
        state = native_state(pre.past_key_values, family, ids.shape[1])
        out = model.generate(ids, max_new_tokens=new_tokens + 1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return Reference(ids[0].tolist(), state, tokens, [lg[0].float() for lg in out.logits])
