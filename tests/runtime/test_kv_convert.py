"""Wire bytes (vLLM block layout) -> KV layers in the engine layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tilepd.control.cache_layout import CacheLayout
from tilepd.runtime.kv_convert import convert, convert_layer, to_wire


def _layers(t: int, h: int, c: int, n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(t, h, c, generator=g) for _ in range(n)]


@pytest.mark.parametrize("order", ["BHNC", "BNHC"])
@pytest.mark.parametrize("dtype, tol", [("float32", 0), ("bfloat16", 1e-2), ("float16", 1e-3)])
def test_roundtrip_orders_and_dtypes(order: str, dtype: str, tol: float) -> None:
    lay = CacheLayout(kind="attn", num_layers=2, block_size=16, num_heads=3, entry_width=8, dtype=dtype, order=order,
                      head_size_k=4, head_size_v=4)
    seq, max_seq = 37, 64
    layers = _layers(seq, 3, 8)
    wire = to_wire(layers, lay)
    # place it like the receive buffer: layer l at l * region_stride
    buf = torch.zeros(lay.buffer_bytes(max_seq), dtype=torch.uint8)
    nb, stride = lay.blocks_for(seq), lay.region_stride(max_seq)
    for l in range(2):
        chunk = np.frombuffer(wire, np.uint8)[l * nb * lay.block_bytes:(l + 1) * nb * lay.block_bytes]
        buf[l * stride:l * stride + len(chunk)] = torch.from_numpy(chunk.copy())
    out = convert(buf, lay, max_seq, seq, torch.float32)
    for a, b in zip(out, layers):
        assert a.shape == (seq, 3, 8)
        torch.testing.assert_close(a, b, atol=tol * 4, rtol=tol)


def test_bhnc_is_not_bnhc() -> None:
    """The order field matters: reading BHNC bytes as BNHC gives different tensors (guards the permute)."""
    kw = dict(kind="attn", num_layers=1, block_size=4, num_heads=2, entry_width=2, dtype="float32", head_size_k=1, head_size_v=1)
    layers = _layers(8, 2, 2, 1)
    wire = torch.frombuffer(bytearray(to_wire(layers, CacheLayout(**kw, order="BHNC"))), dtype=torch.uint8)
    good = convert_layer(wire, CacheLayout(**kw, order="BHNC"), 8, torch.float32)
    bad = convert_layer(wire, CacheLayout(**kw, order="BNHC"), 8, torch.float32)
    assert torch.equal(good, layers[0]) and not torch.equal(bad, layers[0])


def test_fp8_e4m3_upcasts() -> None:
    lay = CacheLayout(kind="attn", num_layers=1, block_size=4, num_heads=1, entry_width=4, dtype="fp8_e4m3", order="BNHC",
                      head_size_k=2, head_size_v=2)
    x = torch.tensor([[0.5, -1.0, 2.0, 0.25]] * 3).view(3, 1, 4)
    raw = torch.zeros(4, 1, 4, dtype=torch.float8_e4m3fn)
    raw[:3] = x.to(torch.float8_e4m3fn)
    out = convert_layer(raw.view(torch.uint8).flatten(), lay, 3, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), x)


def test_fp8_ds_mla_dequantises_latent_and_keeps_rope() -> None:
    lay = CacheLayout(kind="mla", num_layers=1, block_size=2, num_heads=1, entry_width=656, dtype="fp8_ds_mla",
                      kv_lora_rank=512, rope_dim=64)
    t = 2
    q = torch.full((t, 512), 2.0).to(torch.float8_e4m3fn)
    scales = torch.tensor([[0.5, 1.0, 2.0, 4.0]] * t, dtype=torch.float32)
    rope = torch.arange(t * 64, dtype=torch.float32).view(t, 64).to(torch.bfloat16)
    tok = torch.cat([q.view(torch.uint8), scales.view(torch.uint8), rope.view(torch.uint8)], dim=1)
    assert tok.shape == (t, 656)
    out = convert_layer(tok.flatten(), lay, t, torch.float32)
    assert out.shape == (t, 1, 576)
    expect_latent = torch.cat([torch.full((t, 128), 2.0 * s) for s in (0.5, 1.0, 2.0, 4.0)], dim=1)
    assert torch.equal(out[:, 0, :512], expect_latent)
    assert torch.equal(out[:, 0, 512:], rope.float())


def test_tensor_parallel_shards_are_concatenated_by_rank() -> None:
    shard = CacheLayout(kind="attn", num_layers=2, block_size=4, num_heads=1, entry_width=4, dtype="float32", order="BNHC",
                        head_size_k=2, head_size_v=2)
    seq, max_seq, tp = 6, 8, 2
    full = _layers(seq, 2, 4)
    stride = shard.region_stride(max_seq)
    buf = torch.zeros(tp * shard.buffer_bytes(max_seq), dtype=torch.uint8)
    nb = shard.blocks_for(seq)
    for r in range(tp):
        wire = np.frombuffer(to_wire([x[:, r:r + 1] for x in full], shard), np.uint8)
        for l in range(2):
            start = (r * 2 + l) * stride
            buf[start:start + nb * shard.block_bytes] = torch.from_numpy(wire[l * nb * shard.block_bytes:(l + 1) * nb * shard.block_bytes].copy())
    out = convert(buf, shard, max_seq, seq, torch.float32, tp_size=tp)
    for a, b in zip(out, full):
        assert torch.equal(a, b)


def test_indexer_keys_dequantise_to_vllms_fp8_round_trip() -> None:
    """Wire blocks as vLLM's indexer cache holds them (values, then scales, per 64-token block) -> the keys the
    engine gets are exactly HF's keys passed through vLLM's fp8 round trip; a shared layer gets None."""
    from tests.connector.vllm_caches import quant_indexer_blocks
    from tilepd.control.cache_layout import IndexerLayout
    from tilepd.dev.hf_reference import vllm_indexer_fp8_round_trip
    from tilepd.runtime.kv_convert import convert_indexer

    ix = IndexerLayout(layers=[0, 2], block_size=64, head_dim=128)
    lay = CacheLayout(kind="mla", num_layers=3, block_size=64, num_heads=1, entry_width=576, dtype="float32", kv_lora_rank=512,
                      rope_dim=64, indexer=ix)
    t, max_len = 100, 256
    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(t, 128, generator=g) * s for s in (0.01, 30.0)]  # scales far from 1 must survive
    buf = torch.zeros(lay.buffer_bytes(max_len), dtype=torch.uint8)
    for j, k in enumerate(keys):
        blocks = quant_indexer_blocks(k, 64).reshape(-1)
        off = lay.indexer_base(max_len) + j * ix.region_stride(max_len)
        buf[off:off + blocks.numel()] = blocks
    out = convert_indexer(buf, lay, max_len, t, torch.float32)
    assert out is not None and out[1] is None and len(out) == 3
    for got, k in zip((out[0], out[2]), keys):
        assert got.shape == (t, 128)
        assert torch.equal(got, vllm_indexer_fp8_round_trip(k))
        assert (got - k).abs().max() > 0  # it is quantised: the comparison above is not trivially k == k


def test_indexer_block_interior_is_values_then_scales() -> None:
    """One block: bytes [0, 64*128) are the tokens' fp8 values, then 64 fp32 scales (vLLM's CUDA layout)."""
    from tests.connector.vllm_caches import quant_indexer_blocks

    k = torch.zeros(64, 128)
    k[5, 7] = 448.0 * 4  # token 5's group: scale 4, value 448
    blk = quant_indexer_blocks(k, 64)[0]
    assert blk.numel() == 64 * 132
    assert blk[: 64 * 128].view(torch.float8_e4m3fn).view(64, 128)[5, 7].float() == 448.0
    scales = blk[64 * 128:].view(torch.float32)
    assert scales[5] == 4.0 and scales[4] < 1e-3
