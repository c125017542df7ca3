"""HF transformers as a reference for the engine: prefix KV in the engine layout, greedy tokens and per-step logits.

Sparse-attention (DSA) models (glm_moe_dsa, deepseek_v32): the prefix state also carries the lightning
indexer's keys, `KVState.indexer[l]` = [seq_len, index_head_dim] for every layer with an indexer (None for
GLM "shared" layers), read out of transformers' cache (`DynamicIndexedLayer.indexer_keys`,
transformers cache_utils.py:331-363) and put in the layout vLLM's prefill writes (vLLM deepseek_v2.py:816-839:
roped part first, then the rest): for `indexer_rope_interleave` models (GLM) transformers' roped part is
de-interleaved ([rotated evens | rotated odds], modeling_glm_moe_dsa.py:141-150) and is re-interleaved
into pairs here; half-split models (DeepSeek-V3.2) need no change.

vLLM stores indexer keys as fp8 e4m3 with one fp32 scale per 128 values (a power of two, "ue8m0"),
so a decode node receives quantised keys. To compare against "HF with the same quantised keys":

    ref = hf_reference(model_dir, "glm5", 32, prompt_ids=ids, indexer_transform=vllm_indexer_fp8_round_trip)

runs transformers' prefill and its greedy continuation with the PROMPT's indexer keys passed through the
transform as transformers caches them (in its own layout, [batch, tokens, index_head_dim]) - what the
prefill hands over - while keys of generated tokens stay as computed, as the decode engine computes and
keeps them. The returned state holds the transformed keys. `indexer_key_transform(fn, first_n)` is the
same as a context manager.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tilepd.engine import KVState

PROMPT = "Once upon a time there was a little engine that"
KeyTransform = Callable[[torch.Tensor], torch.Tensor]


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


def vllm_indexer_fp8_round_trip(k: torch.Tensor, block: int = 128) -> torch.Tensor:
    """What vLLM's indexer cache keeps of keys k [..., D]: per block of 128 values scale = max(amax, 1e-4) / 448
    rounded up to a power of two (scale_fmt "ue8m0"), values cast to float8 e4m3 (vLLM
    v1/attention/ops/rocm_aiter_mla_sparse.py:150-159, the Triton twin of the CUDA indexer_k_quant_and_cache),
    then dequantised back to k's dtype."""
    shape = k.shape
    x = k.float().reshape(*shape[:-1], shape[-1] // block, block)
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / 448.0
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (x / scale).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(shape).to(k.dtype)


def _transform_first(fn: KeyTransform, k: torch.Tensor, start: int, first_n: int | None) -> torch.Tensor:
    """fn applied to the rows of k [B, S, D] whose positions (start + row) are below first_n (all when None)."""
    n = k.shape[1] if first_n is None else max(0, min(k.shape[1], first_n - start))
    if n == 0:
        return k
    return torch.cat([fn(k[:, :n]), k[:, n:]], dim=1) if n < k.shape[1] else fn(k)


@contextmanager
def indexer_key_transform(fn: KeyTransform | None, first_n: int | None = None) -> Iterator[None]:
    """While active, transformers caches fn(keys) instead of the DSA indexer keys it computed (and scores with
    them), for positions below first_n (every position when None)."""
    if fn is None:
        yield
        return
    from transformers import cache_utils

    # generate() and a plain forward use the dynamic cache; its length before the update is the new keys' first position.
    classes = [c for c in (getattr(cache_utils, "DynamicIndexedLayer", None),) if c]
    if not classes:
        raise RuntimeError("this transformers has no DynamicIndexedLayer (DSA cache); cannot transform indexer keys")
    saved = {c: c.__dict__["update_indexer"] for c in classes}
    for c, orig in saved.items():
        def patched(self, k: torch.Tensor, *a, _orig=orig, **kw) -> torch.Tensor:
            start = self.indexer_keys.shape[1] if getattr(self, "is_indexer_initialized", False) else 0
            return _orig(self, _transform_first(fn, k, start, first_n), *a, **kw)

        c.update_indexer = patched
    try:
        yield
    finally:
        for c, orig in saved.items():
            c.update_indexer = orig


def engine_layout_state(past, family: str, seq_len: int, rope_interleave: bool = True, *, indexer_rope_dim: int = 0,
                        indexer_rope_interleave: bool = False) -> KVState:
    """HF cache -> KVState in the engine layout (DeepSeek k_pe re-interleaved when the model's
    RoPE is interleaved, as vLLM stores it; DSA indexer keys when the cache has them, see the module doc)."""
    layers = []
    indexer: list[torch.Tensor | None] = []
    for layer in past.layers:
        k, v = layer.keys[0], layer.values[0]  # [H, T, D]
        if family == "llama":
            layers.append(torch.cat([k, v], dim=-1).permute(1, 0, 2).contiguous())
        else:  # keys = normalised latent [1, T, r]; values = roped k_pe [1, T, rope]
            layers.append(torch.cat([k, _interleave(v) if rope_interleave else v], dim=-1).permute(1, 0, 2).contiguous())
        keys = getattr(layer, "indexer_keys", None)
        if keys is None or keys.numel() == 0:
            indexer.append(None)
            continue
        keys = keys[0].clone()  # [T, D]
        if indexer_rope_interleave:
            keys[:, :indexer_rope_dim] = _interleave(keys[:, :indexer_rope_dim])
        indexer.append(keys.contiguous())
    has_indexer = any(x is not None for x in indexer)
    return KVState(seq_len=seq_len, layers=layers, indexer=indexer if has_indexer else None)


def hf_reference(model_dir: Path, family: str, new_tokens: int, prompt: str = PROMPT, *, prompt_ids: list[int] | None = None,
                 indexer_transform: KeyTransform | None = None) -> Reference:
    """Greedy reference: HF's prefill state (engine layout), first token + `new_tokens` more, and their logits.
    prompt_ids (token ids) overrides prompt; indexer_transform: see the module doc (DSA models only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if prompt_ids is None:
        ids = AutoTokenizer.from_pretrained(model_dir)(prompt, return_tensors="pt").input_ids
    else:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
    cfg = model.config
    dsa = getattr(cfg, "index_topk", None) is not None
    if indexer_transform is not None and not dsa:
        raise ValueError(f"{model_dir}: indexer_transform given but {cfg.model_type} has no sparse-attention indexer")
    with torch.no_grad(), indexer_key_transform(indexer_transform, first_n=ids.shape[1]):
        pre = model(ids, use_cache=True)
        state = engine_layout_state(pre.past_key_values, family, ids.shape[1], rope_interleave=getattr(cfg, "rope_interleave", True),
                                    indexer_rope_dim=getattr(cfg, "qk_rope_head_dim", 0),
                                    indexer_rope_interleave=bool(getattr(cfg, "indexer_rope_interleave", False)))
        out = model.generate(ids, max_new_tokens=new_tokens + 1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return Reference(ids[0].tolist(), state, tokens, [lg[0].float() for lg in out.logits])
