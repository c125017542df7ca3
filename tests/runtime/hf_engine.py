"""TEST-ONLY stand-in for tilepd.engine, built on HF transformers (llama only).

It exists so the decode server's receive/convert/inject/decode path can be tested
before (and independently of) the real engine: it takes a KVState in the native
layout of INTERFACES §1 and decodes greedily with the HF model. The shipped server
never uses it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch


@dataclass
class KVState:
    seq_len: int
    layers: list[torch.Tensor]


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class DecodeResult:
    tokens: list[int]
    finish_reason: str
    timings: dict = field(default_factory=dict)


class HFEngine:
    def __init__(self, model_dir: Path, step_delay_s: float = 0.0):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
        c = self.model.config
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        eos = c.eos_token_id
        self.config = SimpleNamespace(family="llama", num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                                      head_dim=self.head_dim, vocab_size=c.vocab_size, cache_dtype=torch.float32,
                                      eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]))
        self.capabilities = {"max_tokens": True, "stop_token_ids": True, "ignore_eos": True, "temperature": False}
        self.state: KVState | None = None
        self.step_delay_s = step_delay_s

    def inject(self, state: KVState) -> None:
        self.state = state

    def reset(self) -> None:
        self.state = None

    @torch.no_grad()
    def decode(self, first_token: int, max_tokens: int, sampling: SamplingParams, on_token: Callable[[int], None],
               cancel: threading.Event | None = None) -> DecodeResult:
        from transformers import DynamicCache

        assert self.state is not None
        cache = DynamicCache()
        hd = self.head_dim
        for i, x in enumerate(self.state.layers):  # [T, H, 2*hd]
            k = x[..., :hd].permute(1, 0, 2).unsqueeze(0).contiguous()
            v = x[..., hd:].permute(1, 0, 2).unsqueeze(0).contiguous()
            cache.update(k, v, i)
        pos = self.state.seq_len
        tok = first_token
        out: list[int] = []
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.config.eos_token_ids))
        while len(out) < max_tokens:
            if cancel is not None and cancel.is_set():
                return DecodeResult(out, "cancelled")
            logits = self.model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                                position_ids=torch.tensor([[pos]])).logits
            tok = int(logits[0, -1].argmax())
            pos += 1
            out.append(tok)
            on_token(tok)
            if tok in stops:
                return DecodeResult(out, "stop")
            if self.step_delay_s:
                threading.Event().wait(self.step_delay_s)
        return DecodeResult(out, "length")


def hf_prefill_kv(model, prompt: list[int]) -> tuple[int, list[torch.Tensor]]:
    """What vLLM's prefill would produce: the greedy first token and per-layer [T, H, 2*hd] K|V."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    first = int(out.logits[0, -1].argmax())
    layers = []
    for k, v in _iter_cache(out.past_key_values):
        layers.append(torch.cat([k[0].permute(1, 0, 2), v[0].permute(1, 0, 2)], dim=-1).contiguous())
    return first, layers


def _iter_cache(cache):
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            yield layer.keys, layer.values
    else:
        for i in range(len(cache)):
            yield cache.key_cache[i], cache.value_cache[i]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference: HF generate, greedy, n new tokens (first included), no eos stop."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()
