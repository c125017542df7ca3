"""The worker half of TilePDConnector driven in vLLM 0.33's call order for model runner v2 with a speculator (MTP).

vllm/v1/worker/gpu/model_runner.py (0.33.0) runs a step as: kv_connector.pre_forward (bind_connector_metadata),
the forward (save_kv_layer per attention layer), post_forward(defer_finalize=True): get_finished (via
get_transfer_results) and build_connector_worker_meta, then the drafter's forward (save_kv_layer of the MTP layer,
whose cache it writes now), then finalize_step: wait_for_save, clear_connector_metadata. vLLM's v1 model runner
(gpu_model_runner.py, 0.32 too) defers the same way with a speculator; 0.32's model runner v2 did not (wait_for_save
right after the forward). No vLLM process: the hooks are called here in that order on vLLM-shaped tensors (the
harness of worker_drive.py); tests/connector/test_vllm_source_api.py checks the order in vLLM's source.
"""

from __future__ import annotations

import torch

from tilepd.connector.vllm_connector import TilePDConnector, TilePDConnectorMetadata, TilePDWorkerMetadata

from .worker_drive import bare_worker, send_spec

BLOCK = 32
MAIN = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
MTP = "model.layers.2.self_attn.attn"  # the draft layer: its cache is written by the drafter's forward


def _worker() -> tuple[TilePDConnector, dict[str, torch.Tensor]]:
    flat = torch.randn(3, 12, 2, BLOCK, 64)  # LBHNC
    caches = {name: flat[l] for l, name in enumerate(MAIN + [MTP])}
    return bare_worker(caches, BLOCK, 1, 8 * BLOCK), caches


_spec = send_spec


def _mrv2_step(c: TilePDConnector, caches: dict[str, torch.Tensor], meta: TilePDConnectorMetadata, finished: set[str],
               draft_blocks: list[int], draft_value: float, layers_report: bool = True):
    """One 0.33 MRv2 + MTP step; returns what post_forward collected (get_finished, the worker metadata) and whether
    a job reached the sender before wait_for_save."""
    c.bind_connector_metadata(meta)  # pre_forward
    if layers_report:  # eager / piecewise; a FULL CUDA graph replay reports no layer
        for name in MAIN:
            c.save_kv_layer(name, caches[name], None)
    collected = (c.get_finished(finished), c.build_connector_worker_meta())  # post_forward(defer_finalize=True)
    sent_early = not c._jobs.empty()
    caches[MTP][draft_blocks] = draft_value  # the drafter's forward writes the draft layer's KV of this chunk ...
    if layers_report:
        c.save_kv_layer(MTP, caches[MTP], None)  # ... and reports it
    c.wait_for_save()  # finalize_step
    c.clear_connector_metadata()
    return collected, sent_early


def _staged(c: TilePDConnector, n: int) -> list[torch.Tensor]:
    st = c._jobs.get_nowait()
    assert st.num_blocks == n
    return [c._pool.layer_bytes(st.slot, l, n).view(torch.float32).view(n, 2, BLOCK, 64) for l in range(3)]


def test_final_chunk_stages_the_draft_layer_after_the_drafter_wrote_it() -> None:
    for layers_report in (True, False):
        c, caches = _worker()
        blocks, seq = [4, 7, 1], 3 * BLOCK
        _mrv2_step(c, caches, TilePDConnectorMetadata(sends=[_spec("a", blocks, 0, 2 * BLOCK, seq)]), set(), blocks[:2], 5.0,
                   layers_report)
        (finished, meta), sent_early = _mrv2_step(c, caches, TilePDConnectorMetadata(sends=[_spec("a", blocks, 2 * BLOCK, seq, seq)]),
                                                  {"a"}, blocks[2:], 7.0, layers_report)
        assert finished == (None, None) and meta is None  # nothing to report before the copy: no slot was given back
        assert not sent_early, "the slot went to the sender before wait_for_save: the draft layer was not written yet"
        got = _staged(c, 3)
        for l, name in enumerate(MAIN):
            assert torch.equal(got[l], caches[name][blocks]), f"layer {name}"
        assert bool((got[2][:2] == 5.0).all()) and bool((got[2][2] == 7.0).all()), "the draft layer holds what the drafter wrote"


def test_a_drop_is_reported_by_the_same_step_even_before_wait_for_save() -> None:
    c, caches = _worker()
    _mrv2_step(c, caches, TilePDConnectorMetadata(sends=[_spec("a", [0, 1, 2], 0, 2 * BLOCK, 3 * BLOCK)]), set(), [0, 1], 1.0)
    assert c._pool.free_slots() == 0
    # the request was aborted: the scheduler lists it in the next step's drops; the step's forward reports no layer
    (finished, meta), _ = _mrv2_step(c, caches, TilePDConnectorMetadata(drops=["a"]), {"a"}, [], 0.0, layers_report=False)
    assert finished == (None, None)
    assert isinstance(meta, TilePDWorkerMetadata) and meta.released == {"a": 1}  # the scheduler frees its slot count now
    assert c._pool.free_slots() == 1 and not c._inflight and c._jobs.empty()


def test_the_pre_033_order_stages_the_same_main_layers() -> None:
    """bind -> forward -> wait_for_save -> get_finished / worker metadata (no speculator, or 0.32's model runner v2)."""
    c, caches = _worker()
    blocks, seq = [3, 5], 2 * BLOCK
    c.bind_connector_metadata(TilePDConnectorMetadata(sends=[_spec("a", blocks, 0, seq, seq)]))
    for name in MAIN + [MTP]:
        c.save_kv_layer(name, caches[name], None)
    c.wait_for_save()
    assert c.get_finished({"a"}) == (None, None) and c.build_connector_worker_meta() is None
    c.clear_connector_metadata()
    got = _staged(c, 2)
    for l, name in enumerate(MAIN + [MTP]):
        assert torch.equal(got[l], caches[name][blocks])
