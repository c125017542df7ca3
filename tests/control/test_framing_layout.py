"""Frames, messages and the wire layout: unit tests."""

from __future__ import annotations

import socket
import struct

import pytest

from tilepd.control.framing import MAX_FRAME_BYTES, FrameError, PeerClosed, encode_frame, recv_frame
from tilepd.control.cache_layout import CacheLayout
from tilepd.control.messages import ErrorCode, ProtocolError, parse_message

ATTN = dict(kind="attn", num_layers=2, block_size=16, num_heads=2, entry_width=64, dtype="float32", head_size_k=32, head_size_v=32)


def _pair_with(data: bytes) -> socket.socket:
    a, b = socket.socketpair()
    a.sendall(data)
    a.close()
    return b


def test_frame_roundtrip() -> None:
    s = _pair_with(encode_frame({"type": "ack", "ok": True}))
    assert recv_frame(s) == {"type": "ack", "ok": True}
    with pytest.raises(PeerClosed):
        recv_frame(s)


@pytest.mark.parametrize(
    "raw, why",
    [
        (struct.pack(">I", MAX_FRAME_BYTES + 1), "exceeds"),
        (struct.pack(">I", 0), "empty"),
        (struct.pack(">I", 4) + b"\xff\xfe{}", "UTF-8 JSON"),
        (struct.pack(">I", 3) + b"[1]", "list"),
        (struct.pack(">I", 10) + b"{}", "after 2 of 10"),
    ],
)
def test_bad_frames_raise(raw: bytes, why: str) -> None:
    with pytest.raises(FrameError, match=why):
        recv_frame(_pair_with(raw))


def test_encode_refuses_oversize() -> None:
    with pytest.raises(FrameError, match="cap"):
        encode_frame({"x": "a" * MAX_FRAME_BYTES})


def test_parse_message_names_the_bad_field() -> None:
    with pytest.raises(ProtocolError) as e:
        parse_message({"type": "admit", "transfer_id": "t", "token": "k", "seq_len": -1, "num_blocks": 1})
    assert e.value.code == ErrorCode.MALFORMED and "seq_len" in e.value.message
    with pytest.raises(ProtocolError):
        parse_message({"type": "launch_missiles"})


def test_layout_sizes_follow_interfaces() -> None:
    lay = CacheLayout(**ATTN)
    assert lay.block_bytes == 2 * 16 * 64 * 4
    assert lay.max_blocks(40) == 3 and lay.blocks_for(33) == 3
    assert lay.region_stride(40) == 3 * lay.block_bytes
    assert lay.buffer_bytes(40) == 2 * 3 * lay.block_bytes


@pytest.mark.parametrize(
    "change, why",
    [
        (dict(head_size_v=16), "!= entry_width"),
        (dict(dtype="fp8_ds_mla"), "only valid for kind 'mla'"),
        (dict(kind="mla", kv_lora_rank=512, rope_dim=64), "one latent head"),
    ],
)
def test_layout_refuses_inconsistent_fields(change: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        CacheLayout(**{**ATTN, **change})


def test_fp8_ds_mla_layout_is_656_bytes_per_token() -> None:
    lay = CacheLayout(kind="mla", num_layers=1, block_size=64, num_heads=1, entry_width=656, dtype="fp8_ds_mla",
                      kv_lora_rank=512, rope_dim=64)
    assert lay.token_bytes == 656
    with pytest.raises(ValueError, match="656"):
        CacheLayout(kind="mla", num_layers=1, block_size=64, num_heads=1, entry_width=576, dtype="fp8_ds_mla",
                    kv_lora_rank=512, rope_dim=64)
