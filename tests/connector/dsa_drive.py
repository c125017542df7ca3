"""Drive the real TilePDConnector through the hooks vLLM calls, without a vLLM process (the DSA tests, on CPU and on CUDA).

The connector is built without a VllmConfig (`TilePDConnector._setup`); the scheduler side gets a minimal
scheduler output carrying only what vLLM passes it (request ids, computed and scheduled token counts) and a
KV cache manager that answers `get_block_ids`; the worker side gets `register_kv_caches`, then per step
`bind_connector_metadata`, `save_kv_layer` for each attention layer (vLLM: after the layer ran, the DSA indexer
having written its cache inside that layer) and `wait_for_save`, as vLLM's model runner calls them.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.reserved import reserve_and_attach
from tilepd.connector.vllm_connector import TilePDConnector
from tilepd.contracts.fingerprint import Fingerprint
from tilepd.contracts.service_configs import ConnectorExtraConfig


def vllm_config_for(model_dir: Path | None, *, block_size: int, hf_config: Any = None) -> SimpleNamespace:
    """The parts of vLLM's VllmConfig the connector reads (model, cache and compilation config) for an MLA/DSA model."""
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_dir)
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=True, hf_text_config=hf_config),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=block_size),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )


def bare_connector(role: Any, config: ConnectorExtraConfig, vllm_config: Any, fingerprint: Fingerprint | None = None) -> TilePDConnector:
    """A connector of `role` (vLLM's KVConnectorRole) holding what KVConnectorBase_V1.__init__ would set; `fingerprint`:
    the prefill's (its hello carries it; without one the node does not compare)."""
    c = TilePDConnector.__new__(TilePDConnector)
    c._vllm_config, c._kv_cache_config, c._connector_metadata, c._kv_cache_manager = vllm_config, None, None, None
    c._setup(config, role, fingerprint)
    return c


def prefill(sched: TilePDConnector, worker: TilePDConnector, kv_caches: dict[str, Any], latent_names: list[str],
            block_ids: list[int], seq_len: int, transfer_id: str, host: str, ctrl_port: int, *, chunk: int = 48,
            token: str = "t0k3n") -> None:
    """One request's prefill in `chunk`-token steps; the worker stages each step's completed blocks and hands the
    request to its sender thread after the last step."""
    rid = f"req-{transfer_id}"
    req = SimpleNamespace(request_id=rid, num_prompt_tokens=seq_len, kv_transfer_params={
        "tilepd": {"host": host, "ctrl_port": ctrl_port, "transfer_id": transfer_id, "token": token}})
    sched.on_new_request(req)
    sched._kv_cache_manager = SimpleNamespace(get_block_ids=lambda r: (list(block_ids),))
    done = 0
    while done < seq_len:
        n = min(chunk, seq_len - done)
        new = [SimpleNamespace(req_id=rid, num_computed_tokens=0)] if done == 0 else []
        cached = SimpleNamespace(req_ids=[rid] if done else [], num_computed_tokens=[done] if done else [])
        meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                                          num_scheduled_tokens={rid: n}))
        worker.bind_connector_metadata(meta)
        for name in latent_names:
            worker.save_kv_layer(name, kv_caches[name], None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        done += n


def wait_sent(worker: TilePDConnector, count: int = 1, timeout: float = 60.0) -> dict[str, int]:
    """The worker's counters once its sender thread reported `count` transfers sent (any failure raises)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = worker.events.snapshot()
        if c["failures"]:
            raise AssertionError(f"the connector reported a failed send: {c}")
        if c["sent"] >= count:
            return c
        time.sleep(0.05)
    raise AssertionError(f"the connector sent nothing within {timeout:g} s: {worker.events.snapshot()}")


def random_dsa_state(seq_len: int, *, num_layers: int = 4, indexer_layers: tuple[int, ...] = (0, 1, 3), seed: int = 0):
    """A DSA prefix state without a model: latent [T, 1, 576] and indexer keys [T, 128] for `indexer_layers`
    (default: GLM-like, layer 2 'shared', layer 3 standing for an MTP layer, which always has an indexer)."""
    import torch

    from tilepd.engine import KVState

    g = torch.Generator().manual_seed(seed)
    layers = [torch.randn(seq_len, 1, 576, generator=g) for _ in range(num_layers)]
    indexer = [torch.randn(seq_len, 128, generator=g) * (l + 1) if l in indexer_layers else None for l in range(num_layers)]
    return KVState(seq_len=seq_len, layers=layers, indexer=indexer)


def send_to_receiver(state: Any, *, latent: str = "bfloat16", device: str = "cpu", chunk: int = 48, block_size: int = 64,
                     num_blocks: int = 24, max_seq_len: int = 1024, probe: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """Stage `state` from vLLM-layout caches on `device` through the real connector and send it over tcp into an
    in-process decode-node receiver (control server, slot, tcp receiver, checksum verification).

    Returns (receive buffer as uint8 tensor, the connector's CacheLayout, the DsaCaches sent from); `probe`, when
    given, gets the worker's counters and whether its staging buffer was pinned."""
    import numpy as np
    import torch

    from tests.connector.vllm_caches import dsa_caches
    from tilepd.control.messages import ErrorCode, ProtocolError
    from tilepd.contracts.service_configs import DecodeEndpoint, TransportConfig
    from tilepd.runtime.ctrl_server import ControlServer
    from tilepd.runtime.slot import Slot
    from tilepd.transport import Buffer
    from tilepd.transport.tcp import TcpReceiver

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    caches = dsa_caches(state, block_size=block_size, num_blocks=num_blocks, latent=latent, device=device)
    hf = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, index_topk=16, index_head_dim=128)
    vcfg = vllm_config_for(None, block_size=block_size, hf_config=hf)
    vcfg.cache_config.cache_dtype = "fp8" if latent == "fp8_ds_mla" else "auto"
    rx = TcpReceiver("127.0.0.1", 0)
    recv = np.zeros(32 << 20, np.uint8)
    rx.register(Buffer.from_array(recv))
    slot = Slot(on_arm=rx.arm, on_disarm=rx.disarm)

    def fits(layout: Any, tp: int) -> None:
        if layout.buffer_bytes(max_seq_len) > recv.nbytes:
            raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"receive buffer of {recv.nbytes} bytes too small for {layout.layout_id}")

    srv = ControlServer(slot=slot, receiver=rx, max_seq_len=max_seq_len, check_layout=fits, recv_bytes=torch.from_numpy(recv)).start()
    cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=srv.port, http_port=1),),
                               transport=TransportConfig(name="tcp"), model_family="deepseek_v3", max_seq_len=max_seq_len)
    sched, worker = bare_connector(KVConnectorRole.SCHEDULER, cfg, vcfg), bare_connector(KVConnectorRole.WORKER, cfg, vcfg)
    try:
        worker.register_kv_caches(caches.kv_caches)
        assert worker._cache is not None
        tr = reserve_and_attach(slot, "tx", "t0k3n")
        prefill(sched, worker, caches.kv_caches, caches.latent_names, caches.block_ids, state.seq_len, "tx", "127.0.0.1", srv.port,
                chunk=chunk)
        counters = wait_sent(worker)
        slot.wait_complete(tr, 30)
        if probe is not None:
            assert worker._pool is not None
            probe.update(counters=counters, staging_pinned=worker._pool.buffer.is_pinned(), device=str(worker._cache.device))
        return torch.from_numpy(recv.copy()), worker._cache.layout, caches
    finally:
        worker.shutdown()
        srv.close()
        rx.close()


def expected_wire(caches: Any, layout: Any, seq_len: int, max_seq_len: int = 1024) -> Any:
    """The receive buffer a correct send fills: each region = the request's blocks of that cache, in block-table
    order, exactly as vLLM holds them (computed here independently of the connector)."""
    import torch

    out = torch.zeros(layout.buffer_bytes(max_seq_len), dtype=torch.uint8)
    for seg, layer, off, n in layout.regions(max_seq_len, seq_len):
        name = caches.latent_names[layer] if seg == "kv" else caches.indexer_names[layout.indexer.layers.index(layer)]
        t = caches.kv_caches[name].cpu()
        nb = layout.blocks_for(seq_len) if seg == "kv" else layout.indexer.blocks_for(seq_len)
        blocks = [t[b].contiguous().view(torch.uint8).reshape(-1) for b in caches.block_ids[:nb]]
        data = torch.cat(blocks)
        assert data.numel() == n, (seg, layer, data.numel(), n)
        out[off:off + n] = data
    return out
