"""The connector's DSA path byte for byte on CPU: latent (bf16, fp8_ds_mla, float32) and indexer caches in vLLM's
layouts, a scattered block table, chunked prefill steps, the real connector hooks and sender over tcp into a
decode-node receiver. What lands must be each cache's blocks exactly as vLLM holds them (computed independently
from the cache tensors), and converting it must give back the state (indexer keys as vLLM's fp8 keeps them).
test_connector_gpu_parity.py (marker gpu) runs the same on CUDA caches (pinned staging, CUDA events) and compares."""

from __future__ import annotations

import pytest
import torch

from tests.connector.dsa_drive import expected_wire, random_dsa_state, send_to_receiver
from tilepd.dev.hf_reference import vllm_indexer_fp8_round_trip
from tilepd.runtime.kv_convert import convert, convert_indexer


def _fp8_ds_mla_keeps(x: torch.Tensor) -> torch.Tensor:
    """What an fp8_ds_mla cache keeps of latent rows [T, 576]: 4 x 128 fp8 values with scale amax/448, bf16 rope."""
    t = x.shape[0]
    nope = x[:, :512].view(t, 4, 128)
    scale = nope.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    q = (nope / scale).to(torch.float8_e4m3fn).float() * scale
    return torch.cat([q.view(t, 512), x[:, 512:].bfloat16().float()], dim=1)


@pytest.mark.parametrize("latent", ["bfloat16", "fp8_ds_mla", "float32"])
def test_dsa_blocks_land_exactly_as_vllm_holds_them(latent: str) -> None:
    state = random_dsa_state(300)  # 5 blocks of 64, the last partial; 7 steps of 48 tokens
    recv, layout, caches = send_to_receiver(state, latent=latent)
    assert layout.indexer is not None and layout.indexer.layers == [0, 1, 3] and layout.dtype == latent
    want = expected_wire(caches, layout, state.seq_len)
    assert torch.equal(recv[:want.numel()], want)
    layers = convert(recv, layout, 1024, state.seq_len, torch.float32)
    keys = convert_indexer(recv, layout, 1024, state.seq_len, torch.float32)
    for l, x in enumerate(state.layers):
        ref = x.to(getattr(torch, latent)).float() if latent != "fp8_ds_mla" else _fp8_ds_mla_keeps(x[:, 0])[:, None]
        assert torch.equal(layers[l], ref), l
    assert keys is not None and keys[2] is None
    for l in (0, 1, 3):
        assert torch.equal(keys[l], vllm_indexer_fp8_round_trip(state.indexer[l])), l
