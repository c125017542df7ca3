"""Worker-side incremental staging of the TilePDConnector, step by step, on vLLM-shaped cache tensors.

No vLLM process: the connector's worker half is driven with the metadata the scheduler
half would send (the real-vLLM path is in test_vllm_llama_tcp.py). The connector is built
without `__init__` (which needs a full VllmConfig) and without a sender thread: the test
takes the staged job off the queue itself, as the sender would.
"""

from __future__ import annotations

import torch

from tilepd.connector.vllm_connector import SendSpec, TilePDConnector, TilePDConnectorMetadata

from .worker_drive import bare_worker, send_spec

BLOCK = 32
LAYERS = 2


def _worker(num_slots: int) -> tuple[TilePDConnector, dict[str, torch.Tensor]]:
    flat = torch.randn(LAYERS, 12, 2, BLOCK, 64)  # LBHNC
    caches = {f"model.layers.{l}.self_attn.attn": flat[l] for l in range(LAYERS)}
    return bare_worker(caches, BLOCK, num_slots, 8 * BLOCK), caches


_spec = send_spec


def _step(c: TilePDConnector, *specs: SendSpec, drops: tuple[str, ...] = ()) -> None:
    """One forward: the layers report in order, then wait_for_save (as vLLM calls them)."""
    c.bind_connector_metadata(TilePDConnectorMetadata(sends=list(specs), drops=list(drops)))
    for name in c._cache.layer_names:
        c.save_kv_layer(name, torch.empty(0), None)
    c.wait_for_save()
    c.clear_connector_metadata()


def _staged_blocks(c: TilePDConnector, caches: dict[str, torch.Tensor], blocks: list[int]):
    st = c._jobs.get_nowait()
    assert st.num_blocks == len(blocks)
    for l, name in enumerate(c._cache.layer_names):
        got = c._pool.layer_bytes(st.slot, l, len(blocks)).view(torch.float32)
        assert torch.equal(got, caches[name][blocks].contiguous().flatten()), f"layer {l}"
    return st


def test_each_step_stages_the_blocks_it_completed() -> None:
    c, caches = _worker(num_slots=1)
    blocks, seq = [5, 2, 7, 3], 3 * BLOCK + 4
    _step(c, _spec("a", blocks, 0, 40, seq))  # block 5 complete
    assert c._inflight["a"].num_blocks == 1
    before = caches[c._cache.layer_names[0]][5].clone()
    caches[c._cache.layer_names[0]][5].fill_(-1.0)  # a later write to a staged block must not be re-read
    _step(c, _spec("a", blocks, 40, 80, seq))  # block 2 complete
    assert c._inflight["a"].num_blocks == 2
    _step(c, _spec("a", blocks, 80, seq, seq))  # final: 7 and the partial 3
    caches[c._cache.layer_names[0]][5].copy_(before)  # staging must hold block 5 as it was in step 1
    st = _staged_blocks(c, caches, blocks)
    assert st.chunks == 3 and "a" not in c._inflight


def test_final_step_copies_only_the_last_chunk() -> None:
    c, caches = _worker(num_slots=1)
    blocks, seq = [1, 2, 3, 4, 5], 5 * BLOCK
    _step(c, _spec("a", blocks, 0, 4 * BLOCK, seq))
    c.bind_connector_metadata(TilePDConnectorMetadata(sends=[_spec("a", blocks, 4 * BLOCK, seq, seq)]))
    copies = c._begin_step()
    assert [(sc.first_block, sc.kernel_ids.tolist()) for sc in copies] == [(4, [5])]
    c.wait_for_save()
    _staged_blocks(c, caches, blocks)


def test_without_a_free_slot_a_chunk_is_deferred_and_staged_whole_at_the_end() -> None:
    c, caches = _worker(num_slots=1)
    _step(c, _spec("a", [0, 1], 0, BLOCK, 2 * BLOCK))  # a holds the only slot
    _step(c, _spec("b", [6, 8, 9], 0, 2 * BLOCK, 3 * BLOCK))  # no slot: b is deferred, the step goes on
    assert "b" not in c._inflight
    _step(c, _spec("a", [0, 1], BLOCK, 2 * BLOCK, 2 * BLOCK))
    c._pool.release(_staged_blocks(c, caches, [0, 1]).slot)  # the sender is done with a
    _step(c, _spec("b", [6, 8, 9], 2 * BLOCK, 3 * BLOCK, 3 * BLOCK))
    _staged_blocks(c, caches, [6, 8, 9])


def test_drop_returns_the_slot_of_a_request_gone_before_its_final_step() -> None:
    c, _ = _worker(num_slots=1)
    _step(c, _spec("a", [0, 1, 2], 0, 2 * BLOCK, 3 * BLOCK))
    assert c._pool.free_slots() == 0
    _step(c, drops=("a",))
    assert c._pool.free_slots() == 1 and not c._inflight and c._jobs.empty()


def test_preempted_request_is_restaged_from_block_zero_with_its_new_blocks() -> None:
    c, caches = _worker(num_slots=1)
    _step(c, _spec("a", [0, 1, 2], 0, 2 * BLOCK, 3 * BLOCK))
    _step(c, _spec("a", [9, 10, 11], 0, 2 * BLOCK, 3 * BLOCK))  # recomputed into other blocks
    _step(c, _spec("a", [9, 10, 11], 2 * BLOCK, 3 * BLOCK, 3 * BLOCK))
    _staged_blocks(c, caches, [9, 10, 11])
