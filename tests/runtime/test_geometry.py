"""Which wire layouts a decode node accepts for its model, and the messages when it does not."""

from __future__ import annotations

import pytest
import torch

from tilepd.control.cache_layout import CacheLayout
from tilepd.control.messages import ProtocolError
from tilepd.runtime.geometry import CacheGeometry, check_layout, geometry_from_spec, recv_buffer_bytes

DS = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_nextn_predict_layers": 1}
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}


def _mla(layers: int, tp: int = 1) -> tuple[CacheLayout, int]:
    return CacheLayout(kind="mla", num_layers=layers, block_size=16, num_heads=1, entry_width=576, dtype="bfloat16",
                       kv_lora_rank=512, rope_dim=64), tp


def test_mla_accepts_main_layers_or_main_plus_mtp() -> None:
    g = geometry_from_spec(DS, __import__("torch").bfloat16)
    cap = recv_buffer_bytes(g, 1024, "auto", "cuda")
    for layers in (3, 4):
        check_layout(_mla(layers)[0], g, max_seq_len=1024, capacity=cap)
    with pytest.raises(ProtocolError, match="num_layers=5.*3 \\(or 4 with MTP\\)"):
        check_layout(_mla(5)[0], g, max_seq_len=1024, capacity=cap)
    with pytest.raises(ProtocolError, match="rank 0 only"):
        check_layout(_mla(3)[0], g, max_seq_len=1024, capacity=cap, tp_size=2)


def test_attention_heads_must_add_up_across_tp_ranks() -> None:
    import torch

    g = geometry_from_spec(LLAMA, torch.float32)
    cap = recv_buffer_bytes(g, 256, "auto", "cpu")
    lay = CacheLayout(kind="attn", num_layers=2, block_size=16, num_heads=1, entry_width=64, dtype="float32",
                      head_size_k=32, head_size_v=32)
    check_layout(lay, g, max_seq_len=256, capacity=cap, tp_size=2)
    with pytest.raises(ProtocolError, match="1 KV heads per layer on each of 1 TP rank"):
        check_layout(lay, g, max_seq_len=256, capacity=cap, tp_size=1)


def test_too_small_buffer_says_what_to_set() -> None:
    import torch

    g = geometry_from_spec(LLAMA, torch.float32)
    cap = recv_buffer_bytes(g, 256, "bfloat16", "cuda")  # sized for 16-bit KV
    lay = CacheLayout(kind="attn", num_layers=2, block_size=16, num_heads=2, entry_width=64, dtype="float32",
                      head_size_k=32, head_size_v=32)
    with pytest.raises(ProtocolError, match="kv_cache_dtype"):
        check_layout(lay, g, max_seq_len=256 * 4, capacity=cap)


def test_dsa_geometry_follows_vllms_indexer_schedule() -> None:
    """glm_moe_dsa with index_topk_freq 2: layer 2 is 'shared' (no indexer cache), the MTP layer has one
    (vLLM deepseek_v2.py:1140-1168); the receive buffer grows by 132 bytes per token per indexer layer."""
    from tilepd.runtime.geometry import geometry_from_spec

    cfg = {"model_type": "glm_moe_dsa", "num_hidden_layers": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "num_nextn_predict_layers": 1, "index_topk": 16, "index_head_dim": 128, "index_topk_freq": 2}
    g = geometry_from_spec(cfg, torch.float32)
    assert g.has_indexer and g.indexer_layers == (0, 1, 3) and g.index_head_dim == 128
    dense = geometry_from_spec({**cfg, "model_type": "deepseek_v3", "index_topk": None, "index_head_dim": None}, torch.float32)
    assert not dense.has_indexer
    assert recv_buffer_bytes(g, 100, "auto", "cpu") - recv_buffer_bytes(dense, 100, "auto", "cpu") == 3 * (100 + 256) * 132
    with pytest.raises(ValueError, match="index_head_dim"):
        geometry_from_spec({**cfg, "model_type": "deepseek_v32", "index_head_dim": None}, torch.float32)


def test_dsa_indexer_segment_is_checked_by_name() -> None:
    from tilepd.control.cache_layout import IndexerLayout

    g = CacheGeometry("deepseek_v3", "mla", 3, 1, 576, kv_lora_rank=512, rope_dim=64, num_mtp_layers=1, index_head_dim=128,
                      indexer_layers=(0, 1, 3))
    lay = CacheLayout(kind="mla", num_layers=3, block_size=64, num_heads=1, entry_width=576, dtype="bfloat16", kv_lora_rank=512,
                      rope_dim=64, indexer=IndexerLayout(layers=[0, 1], block_size=64, head_dim=128))
    cap = recv_buffer_bytes(g, 512, "auto", "cuda")
    check_layout(lay, g, max_seq_len=512, capacity=cap)  # main layers only (no MTP ran): layers 0 and 1
    check_layout(lay.model_copy(update={"num_layers": 4, "indexer": IndexerLayout(layers=[0, 1, 3], block_size=64, head_dim=128)}),
                 g, max_seq_len=512, capacity=cap)  # with the MTP layer
    for update, needle in [({"indexer": None}, "no indexer segment"),
                           ({"indexer": IndexerLayout(layers=[0, 1, 2], block_size=64, head_dim=128)}, "keeps them for layers [0, 1]"),
                           ({"indexer": IndexerLayout(layers=[0, 1], block_size=64, head_dim=256)}, "index_head_dim 128")]:
        with pytest.raises(ProtocolError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            check_layout(lay.model_copy(update=update), g, max_seq_len=512, capacity=cap)
    plain = CacheGeometry("deepseek_v3", "mla", 3, 1, 576, kv_lora_rank=512, rope_dim=64)
    with pytest.raises(ProtocolError, match="no sparse-attention indexer"):
        check_layout(lay, plain, max_seq_len=512, capacity=cap)
