"""Which wire layouts a decode node accepts for its model, and the messages when it does not."""

from __future__ import annotations

import pytest

from tilepd.control.layout import CacheLayout
from tilepd.control.messages import ProtocolError
from tilepd.runtime.geometry import check_layout, geometry_from_spec, recv_buffer_bytes

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
