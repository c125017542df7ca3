"""Layout reader and staging gather on real vLLM-shaped cache tensors (no vLLM process)."""

from __future__ import annotations

import pytest
import torch

from tilepd.connector.paged_cache import ModelCacheFacts, UnsupportedCacheLayout, read_paged_cache
from tilepd.connector.staging import StagingPool, gather_blocks

LLAMA = ModelCacheFacts(use_mla=False, cache_dtype="auto", scheduler_block_size=128, head_size=32)
MLA = ModelCacheFacts(use_mla=True, cache_dtype="auto", scheduler_block_size=16, kv_lora_rank=512, rope_dim=64)


def _flat_views(num_layers: int, shape: tuple[int, int, int, int], perm: tuple[int, ...], dtype=torch.float32):
    """Caches like vLLM >= 0.29 allocates them: one flat buffer, per-layer logical [B, H, N, C] views.

    `perm` is the physical order of the logical [L, B, H, N, C] dims (vllm KVCacheLayout values).
    """
    b, h, n, c = shape
    logical = (num_layers, b, h, n, c)
    phys_shape = tuple(logical[i] for i in perm)
    flat = torch.randn(phys_shape).to(dtype) if dtype.is_floating_point else torch.randint(0, 255, phys_shape, dtype=dtype)
    inv = [perm.index(i) for i in range(5)]
    five = flat.permute(*inv)  # logical view
    return {f"model.layers.{l}.self_attn.attn": five[l] for l in range(num_layers)}


def test_cpu_attn_llama_layout_is_read_from_the_tensors() -> None:
    caches = _flat_views(2, (64, 2, 128, 64), (0, 1, 2, 3, 4))  # LBHNC
    pc = read_paged_cache(caches, LLAMA)
    lay = pc.layout
    assert (lay.kind, lay.num_layers, lay.block_size, lay.num_heads, lay.entry_width) == ("attn", 2, 128, 2, 64)
    assert (lay.order, lay.dtype, lay.head_size_k, lay.head_size_v) == ("BHNC", "float32", 32, 32)
    assert lay.block_bytes == 2 * 128 * 64 * 4
    assert pc.layer_names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_layers_are_ordered_by_index_not_by_name() -> None:
    caches = _flat_views(11, (4, 2, 32, 64), (0, 1, 2, 3, 4))
    pc = read_paged_cache(dict(reversed(list(caches.items()))), ModelCacheFacts(False, "auto", 32, head_size=32))
    assert [n.split(".")[2] for n in pc.layer_names] == [str(i) for i in range(11)]


@pytest.mark.parametrize(
    ("perm", "order"),
    [((0, 1, 2, 3, 4), "BHNC"), ((0, 1, 3, 2, 4), "BNHC"), ((1, 0, 2, 3, 4), "BHNC"), ((1, 0, 3, 2, 4), "BNHC")],
    ids=["LBHNC", "LBNHC", "BLHNC", "BLNHC"],
)
def test_gather_sends_each_block_exactly_as_held(perm: tuple[int, ...], order: str) -> None:
    caches = _flat_views(3, (10, 2, 32, 64), perm, dtype=torch.bfloat16)
    facts = ModelCacheFacts(False, "auto", 64, head_size=32)  # scheduler block = 2 kernel blocks
    pc = read_paged_cache(caches, facts)
    assert pc.layout.order == order and pc.blocks_per_sched_block == 2
    ids = pc.kernel_block_ids([4, 1], seq_len=70)  # 70 tokens -> 3 kernel blocks
    assert ids == [8, 9, 2]
    pool = StagingPool(pc.layout, max_seq_len=128, num_slots=2)
    slot = pool.acquire()
    assert slot is not None
    idx = torch.tensor(ids)
    for l, view in enumerate(pc.physical_views):
        gather_blocks(view, idx, pool.layer_bytes(slot, l, len(ids)))
    for l, name in enumerate(pc.layer_names):
        got = pool.layer_bytes(slot, l, 3).view(torch.bfloat16)
        logical = caches[name][ids]  # [3, H, N, C]
        want = logical if order == "BHNC" else logical.permute(0, 2, 1, 3)
        assert torch.equal(got, want.contiguous().flatten())
    segs = pool.segments(slot, 3, dst_base=1000, dst_region_stride=5000)
    assert segs == [(slot.offset + l * pool.region_stride, 1000 + l * 5000, 3 * pc.layout.block_bytes) for l in range(3)]


def test_mla_latent_layout() -> None:
    caches = _flat_views(2, (40, 1, 16, 576), (0, 1, 2, 3, 4))
    lay = read_paged_cache(caches, MLA).layout
    assert (lay.kind, lay.num_heads, lay.entry_width, lay.kv_lora_rank, lay.rope_dim) == ("mla", 1, 576, 512, 64)


def test_fp8_ds_mla_656_byte_entries() -> None:
    caches = _flat_views(2, (40, 1, 64, 656), (0, 1, 2, 3, 4), dtype=torch.uint8)
    facts = ModelCacheFacts(True, "fp8_ds_mla", 64, kv_lora_rank=512, rope_dim=64)
    lay = read_paged_cache(caches, facts).layout
    assert (lay.dtype, lay.entry_width, lay.block_bytes) == ("fp8_ds_mla", 656, 64 * 656)


@pytest.mark.parametrize(
    ("caches", "facts", "needle"),
    [
        (_flat_views(2, (8, 2, 32, 64), (0, 2, 1, 3, 4)), LLAMA, "supported physical layouts are LBHNC"),  # LHBNC
        (_flat_views(2, (8, 2, 32, 80), (0, 1, 2, 3, 4)), ModelCacheFacts(False, "auto", 32, head_size=32), "entry width 80"),
        (_flat_views(2, (8, 1, 16, 512), (0, 1, 2, 3, 4)), MLA, "MLA cache entry width 512"),
        (_flat_views(2, (8, 1, 64, 576), (0, 1, 2, 3, 4), dtype=torch.uint8), ModelCacheFacts(True, "fp8_e5m2", 64, kv_lora_rank=512, rope_dim=64), "not a known encoding"),
        ({"model.layers.0.attn": torch.zeros(2, 8, 2, 32, 32)}, LLAMA, "separate K/V"),
        (_flat_views(2, (8, 2, 48, 64), (0, 1, 2, 3, 4)), ModelCacheFacts(False, "auto", 64, head_size=32), "not a multiple"),
    ],
    ids=["LHBNC", "attn-width", "mla-width", "fp8-e5m2", "5d-kv", "block-ratio"],
)
def test_unknown_layouts_are_refused_with_a_reason(caches, facts, needle: str) -> None:
    with pytest.raises(UnsupportedCacheLayout, match=needle):
        read_paged_cache(caches, facts)


def test_staging_pool_slots_are_exclusive() -> None:
    pc = read_paged_cache(_flat_views(1, (4, 1, 16, 576), (0, 1, 2, 3, 4)), MLA)
    pool = StagingPool(pc.layout, 32, num_slots=2)
    a, b = pool.acquire(), pool.acquire()
    assert a is not None and b is not None and a.offset != b.offset
    assert pool.acquire(timeout=0.0) is None
    pool.release(a)
    assert pool.acquire() == a
    with pytest.raises(RuntimeError, match="twice"):
        pool.release(b)
        pool.release(b)


DSA = ModelCacheFacts(use_mla=True, cache_dtype="auto", scheduler_block_size=64, kv_lora_rank=512, rope_dim=64, index_head_dim=128)


def _dsa_caches(ix_layers=(0, 1), width: int = 132, dtype=torch.uint8) -> dict[str, torch.Tensor]:
    caches = {k: v.to(torch.bfloat16) for k, v in _flat_views(3, (8, 1, 64, 576), (0, 1, 2, 3, 4)).items()}
    ix = _flat_views(len(ix_layers), (8, 1, 64, width), (0, 1, 2, 3, 4), dtype=dtype)
    for j, l in enumerate(ix_layers):
        caches[f"model.layers.{l}.self_attn.indexer.k_cache"] = ix[f"model.layers.{j}.self_attn.attn"]
    return caches


def test_dsa_latent_and_indexer_caches_are_read_per_layer() -> None:
    """A second cache per layer index is a DSA indexer cache: it gets its own segment in the layout."""
    pc = read_paged_cache(_dsa_caches(), DSA)
    lay = pc.layout
    assert (lay.dtype, lay.num_layers) == ("bfloat16", 3) and lay.indexer is not None
    assert (lay.indexer.layers, lay.indexer.block_size, lay.indexer.token_bytes) == ([0, 1], 64, 132)
    assert pc.indexer is not None and pc.indexer.of_layer == {0: 0, 1: 1}
    assert "idx2x128/bs64/fp8_e4m3_scale128" in lay.layout_id


def test_fp8_kv_cache_dtype_on_flashmla_sparse_is_read_as_fp8_ds_mla() -> None:
    """vLLM serves --kv-cache-dtype fp8 as fp8_ds_mla on FlashMLA-sparse (mla_attention.py:358-368): 656-byte entries."""
    caches = _flat_views(2, (8, 1, 64, 656), (0, 1, 2, 3, 4), dtype=torch.uint8)
    facts = ModelCacheFacts(True, "fp8", 64, kv_lora_rank=512, rope_dim=64)
    assert read_paged_cache(caches, facts).layout.dtype == "fp8_ds_mla"


@pytest.mark.parametrize(
    ("caches", "facts", "needle"),
    [
        (_dsa_caches(width=68), DSA, "mxfp4 or other indexer encoding"),
        (_dsa_caches(dtype=torch.float32), DSA, "expected uint8"),
        ({k: v for k, v in _dsa_caches().items() if "indexer" not in k}, DSA, "registered no indexer cache"),
        (_dsa_caches(), ModelCacheFacts(True, "auto", 64, kv_lora_rank=512, rope_dim=64), "no index_topk"),
        (_flat_views(2, (8, 1, 64, 352), (0, 1, 2, 3, 4), dtype=torch.uint8), ModelCacheFacts(True, "nvfp4_ds_mla", 64, kv_lora_rank=512, rope_dim=64), "not nvfp4_ds_mla"),
    ],
    ids=["mxfp4-width", "float-indexer", "missing-indexer", "indexer-on-dense", "nvfp4"],
)
def test_unknown_dsa_caches_are_refused_with_a_reason(caches, facts, needle: str) -> None:
    with pytest.raises(UnsupportedCacheLayout, match=needle):
        read_paged_cache(caches, facts)


def test_shuffled_indexer_layout_is_refused() -> None:
    from tilepd.connector.paged_cache import cache_role

    class DeepseekV32IndexerCache:  # the class name vLLM registers; the ROCm shuffled layout flag set
        uses_shuffled_layout = True

    with pytest.raises(UnsupportedCacheLayout, match="shuffled"):
        cache_role("model.layers.0.self_attn.indexer.k_cache", DeepseekV32IndexerCache())
    assert cache_role("model.layers.0.self_attn.attn", object()) == "kv"


def test_indexer_in_its_own_kv_cache_group_reads_that_groups_block_ids() -> None:
    """vLLM groups caches of different block sizes separately; each cache reads its own group's block table."""
    caches = _dsa_caches()
    groups = {n: (1 if "indexer" in n else 0) for n in caches}
    pc = read_paged_cache(caches, DSA, groups=groups)
    assert pc.group == 0 and pc.indexer is not None and pc.indexer.group == 1
    with pytest.raises(UnsupportedCacheLayout, match="several KV cache groups"):
        read_paged_cache(caches, DSA, groups={**groups, "model.layers.2.self_attn.attn": 2})
