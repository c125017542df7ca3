"""The decode engine's cache geometry, and what wire layouts it can take.

The receive buffer is sized from this geometry before any sender connects (so
`/health` can be green at startup), and every hello's `CacheLayout` is checked
against it: a prefill instance whose cache does not describe the same model is
refused with a message naming the field that differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from tilepd.control.cache_layout import FP8_DS_MLA_ENTRY_BYTES, ITEMSIZE, CacheLayout, indexer_token_bytes
from tilepd.control.messages import ErrorCode, ProtocolError

# vLLM block sizes top out at 256 tokens; regions round max_seq_len up to a block
MAX_BLOCK_SLACK = 256

_FAMILY_KIND = {"llama": "attn", "deepseek_v3": "mla", "deepseek_v32": "mla", "glm_moe_dsa": "mla"}


@dataclass(frozen=True)
class CacheGeometry:
    family: str
    kind: Literal["attn", "mla"]
    num_layers: int
    num_heads: int  # KV heads (attn) or 1 (mla)
    entry_width: int  # head_size_k + head_size_v, or kv_lora_rank + rope_dim
    head_size_k: int | None = None
    head_size_v: int | None = None
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    cache_dtype: torch.dtype = torch.float32
    # MTP draft layers whose cache a prefill may also send (after the main layers), deepseek_v3 only
    num_mtp_layers: int = 0
    # DSA (glm_moe_dsa, deepseek_v32): the lightning indexer's key width, and the layers (main, then MTP)
    # that keep an indexer cache; () for models without an indexer
    index_head_dim: int | None = None
    indexer_layers: tuple[int, ...] = ()

    @property
    def has_indexer(self) -> bool:
        return self.index_head_dim is not None

    def describe(self) -> dict[str, Any]:
        d = {"family": self.family, "kind": self.kind, "num_layers": self.num_layers, "num_heads": self.num_heads,
             "entry_width": self.entry_width, "cache_dtype": str(self.cache_dtype).removeprefix("torch.")}
        if self.kind == "attn":
            d.update(head_size_k=self.head_size_k, head_size_v=self.head_size_v)
        else:
            d.update(kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim)
        if self.has_indexer:
            d.update(index_head_dim=self.index_head_dim, indexer_layers=list(self.indexer_layers))
        return d


def _get(obj: Any, *names: str) -> Any:
    for n in names:
        v = obj.get(n) if isinstance(obj, dict) else getattr(obj, n, None)
        if v is not None:
            return v
    return None


def geometry_from_spec(spec: Any, cache_dtype: torch.dtype) -> CacheGeometry:
    """Build from an engine ModelSpec or an HF config dict (same field names where they agree)."""
    family = str(_get(spec, "family", "model_type"))
    kind = _FAMILY_KIND.get(family)
    if kind is None:
        raise ValueError(f"model family {family!r} has no known KV layout (known: {sorted(_FAMILY_KIND)})")
    layers = int(_get(spec, "num_layers", "num_hidden_layers"))
    if kind == "attn":
        heads = int(_get(spec, "num_kv_heads", "num_key_value_heads", "num_attention_heads"))
        hd = _get(spec, "head_dim")
        if hd is None:
            hd = int(_get(spec, "hidden_size")) // int(_get(spec, "num_attention_heads"))
        hd = int(hd)
        return CacheGeometry(family, "attn", layers, heads, 2 * hd, head_size_k=hd, head_size_v=hd, cache_dtype=cache_dtype)
    rank = int(_get(spec, "kv_lora_rank"))
    rope = int(_get(spec, "qk_rope_head_dim", "rope_dim"))
    mtp = int(_get(spec, "num_mtp_layers", "num_nextn_predict_layers") or 0)
    # DSA: an engine ModelSpec has index_topk 0 / index_head_dim 0 for dense MLA; an HF config lacks the keys
    ihd, topk = _get(spec, "index_head_dim"), _get(spec, "index_topk")
    dsa = bool(ihd) and bool(topk)
    if not dsa and family in ("deepseek_v32", "glm_moe_dsa"):
        raise ValueError(f"{family} model without index_head_dim / index_topk: its indexer cache cannot be sized")
    return CacheGeometry(family, "mla", layers, 1, rank + rope, kv_lora_rank=rank, rope_dim=rope, cache_dtype=cache_dtype,
                         num_mtp_layers=mtp, index_head_dim=int(ihd) if dsa else None,
                         indexer_layers=indexer_layers(spec, layers, mtp) if dsa else ())


def indexer_layers(spec: Any, num_layers: int, num_mtp_layers: int) -> tuple[int, ...]:
    """Layers that keep an indexer cache, as vLLM 0.32 decides it (model_executor/models/deepseek_v2.py:1138-1168):
    a layer whose top-k is "shared" (reused from the previous full layer) has none, MTP layers always have one.
    Read from `indexer_types` (HF GlmMoeDsaConfig) or vLLM's own keys (index_topk_pattern / index_topk_freq /
    index_skip_topk_offset); an engine spec may state `indexer_layers` directly."""
    given = _get(spec, "indexer_layers")
    if given is not None:
        return tuple(int(i) for i in given)
    has = getattr(spec, "has_indexer", None)
    if callable(has):  # tilepd.model_format.model_spec.ModelSpec knows it per layer (main, then MTP)
        return tuple(l for l in range(num_layers + num_mtp_layers) if has(l))
    types = _get(spec, "indexer_types")
    pattern = _get(spec, "index_topk_pattern")
    if types:
        full = [t == "full" for t in types]
    elif pattern is not None:
        full = [c != "S" for c in pattern] if isinstance(pattern, str) else [t != "shared" and t != "S" for t in pattern]
    else:
        freq = int(_get(spec, "index_topk_freq") or 1)
        off = _get(spec, "index_skip_topk_offset")
        offset = 2 if off is None else int(off)
        full = [max(i - offset + 1, 0) % max(freq, 1) == 0 for i in range(num_layers)]
    full = (full + [True] * num_layers)[:num_layers]  # vLLM: layers past the pattern run their indexer
    return tuple(i for i in range(num_layers) if full[i]) + tuple(range(num_layers, num_layers + num_mtp_layers))


def geometry_from_hf_config(model_dir: Path, cache_dtype: torch.dtype = torch.float32) -> CacheGeometry:
    return geometry_from_spec(json.loads((Path(model_dir) / "config.json").read_text()), cache_dtype)


def wire_token_bytes(geom: CacheGeometry, kv_cache_dtype: str, device: str) -> int:
    """Largest per-token, per-layer byte count a sender of this model may ship."""
    if kv_cache_dtype == "fp8_ds_mla":
        return geom.num_heads * max(FP8_DS_MLA_ENTRY_BYTES, geom.entry_width)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        size = 1
    elif kv_cache_dtype in ITEMSIZE:
        size = ITEMSIZE[kv_cache_dtype]
    else:  # "auto": the model's dtype on the prefill side; fp32 on CPU tests, 16-bit on GPUs
        size = max(torch.finfo(geom.cache_dtype).bits // 8, 2 if device == "cuda" else 4)
    return geom.num_heads * geom.entry_width * size


def recv_buffer_bytes(geom: CacheGeometry, max_seq_len: int, kv_cache_dtype: str, device: str) -> int:
    layers = geom.num_layers + geom.num_mtp_layers
    n = layers * (max_seq_len + MAX_BLOCK_SLACK) * wire_token_bytes(geom, kv_cache_dtype, device)
    if geom.has_indexer:
        assert geom.index_head_dim is not None
        n += len(geom.indexer_layers) * (max_seq_len + MAX_BLOCK_SLACK) * indexer_token_bytes(geom.index_head_dim)
    return n


def check_layout(layout: CacheLayout, geom: CacheGeometry, *, max_seq_len: int, capacity: int, tp_size: int = 1) -> None:
    """Raise ProtocolError(layout_mismatch) naming the first field that differs.

    With prefill tensor parallelism (tp_size > 1, attention only) each rank holds num_heads/tp_size
    heads and sends its own share; the MLA latent is the same on every rank, so only rank 0 sends it.
    """

    def bad(field: str, theirs: Any, ours: Any) -> ProtocolError:
        return ProtocolError(
            ErrorCode.LAYOUT_MISMATCH,
            f"the prefill cache has {field}={theirs} but this decode node's {geom.family} model has {field}={ours}: "
            "serve the same model on both sides (check the served model and its revision)",
        )

    if layout.kind != geom.kind:
        raise bad("kind", layout.kind, geom.kind)
    if layout.num_layers not in (geom.num_layers, geom.num_layers + geom.num_mtp_layers):
        ours = geom.num_layers if not geom.num_mtp_layers else f"{geom.num_layers} (or {geom.num_layers + geom.num_mtp_layers} with MTP)"
        raise bad("num_layers", layout.num_layers, ours)
    if layout.kind == "mla" and tp_size > 1:
        raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"an MLA latent cache is the same on every prefill TP rank: send it "
                            f"from rank 0 only, with tp_size 1 (got tp_size {tp_size})")
    if layout.num_heads * tp_size != geom.num_heads:
        raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"the prefill cache holds {layout.num_heads} KV heads per layer on each of "
                            f"{tp_size} TP rank(s), this decode node's model has {geom.num_heads}")
    if geom.kind == "attn":
        if (layout.head_size_k, layout.head_size_v) != (geom.head_size_k, geom.head_size_v):
            raise bad("head_size_k/v", (layout.head_size_k, layout.head_size_v), (geom.head_size_k, geom.head_size_v))
    else:
        if (layout.kv_lora_rank, layout.rope_dim) != (geom.kv_lora_rank, geom.rope_dim):
            raise bad("kv_lora_rank/rope_dim", (layout.kv_lora_rank, layout.rope_dim), (geom.kv_lora_rank, geom.rope_dim))
    if layout.dtype == "fp8_ds_mla" and geom.kind != "mla":
        raise bad("dtype", layout.dtype, "an attention cache")
    _check_indexer(layout, geom)
    need = layout.buffer_bytes(max_seq_len) * tp_size
    if need > capacity:
        raise ProtocolError(
            ErrorCode.LAYOUT_MISMATCH,
            f"the prefill cache layout {layout.layout_id} needs {need} bytes for max_seq_len {max_seq_len} but this decode "
            f"node's receive buffer holds {capacity}: set the decode node's kv_cache_dtype to the prefill's "
            f"({layout.dtype}) or lower max_seq_len",
        )


def _check_indexer(layout: CacheLayout, geom: CacheGeometry) -> None:
    """A DSA model needs the indexer keys of every layer that keeps them; a model without an indexer takes none."""
    ix = layout.indexer
    if not geom.has_indexer:
        if ix is not None:
            raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"the prefill cache carries indexer keys ({layout.layout_id}) but this "
                                f"decode node's {geom.family} model has no sparse-attention indexer: serve the same model on both sides")
        return
    if ix is None:
        raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"this decode node serves {geom.family}, a sparse-attention (DSA) model whose "
                            f"decode needs the lightning indexer's key cache, but the prefill's layout {layout.layout_id} has no "
                            "indexer segment: upgrade the prefill hosts' tilepd connector (layout version 2 ships the indexer cache) "
                            "and serve the same DSA model there")
    want = tuple(i for i in geom.indexer_layers if i < layout.num_layers)
    if ix.head_dim != geom.index_head_dim:
        raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"the prefill's indexer keys are {ix.head_dim} wide, this decode node's "
                            f"{geom.family} model has index_head_dim {geom.index_head_dim}: serve the same model on both sides")
    if tuple(ix.layers) != want:
        raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"the prefill sends indexer keys for layers {ix.layers}, this decode node's "
                            f"{geom.family} model keeps them for layers {list(want)} (indexer_types / index_topk_pattern differ): "
                            "serve the same model and config on both sides")
