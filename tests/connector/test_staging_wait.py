"""Staging slots held by transfers to a stalled decode node never hold the whole vLLM prefill: a claimed request
waits for a slot at admission (vLLM skips it, other requests go on) for at most STAGING_WAIT_S, then its hand-off is
refused with a reason in `tilepd_handoff`, the key the router reads. Both halves of the connector are driven
without an engine (as in test_incremental_staging.py) with vLLM's own Request and KVConnectorOutput; the test's
clock is a counter it advances, so the bound is crossed exactly, never by the box being slow."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from tilepd.contracts.marker import RESULT_KEY
from tilepd.connector.staging import StagingPool
from tilepd.connector.vllm_connector import STAGING_WAIT_S, KVConnectorRole, TilePDConnector
from tilepd.control.cache_layout import CacheLayout
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig

NODE = DecodeEndpoint(name="d0", host="127.0.0.1", ctrl_port=5556, http_port=8100)
LAYOUT = CacheLayout(kind="attn", num_layers=2, block_size=16, num_heads=2, entry_width=64, dtype="float32", head_size_k=32, head_size_v=32)


def _config(slots: int) -> ConnectorExtraConfig:
    return ConnectorExtraConfig(decode_allowlist=(NODE,), transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=256,
                                staging_slots=slots)


def _request(rid: str, marked: bool = True) -> Request:
    params = {"tilepd": {"host": NODE.host, "ctrl_port": NODE.ctrl_port, "transfer_id": f"tx-{rid}", "token": "t"}} if marked else None
    return Request(request_id=rid, prompt_token_ids=list(range(1, 40)), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params} if params else None))


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _connector(role: KVConnectorRole, slots: int = 1) -> TilePDConnector:
    c = TilePDConnector.__new__(TilePDConnector)
    c._setup(_config(slots), role)
    return c


def test_a_claim_waits_for_a_slot_at_admission_then_is_refused_with_a_reason() -> None:
    sched, worker, clock = _connector(KVConnectorRole.SCHEDULER), _connector(KVConnectorRole.WORKER), _Clock()
    sched._clock = clock
    a, b, c, plain = _request("a"), _request("b"), _request("c"), _request("plain", marked=False)
    for r in (a, b, c, plain):
        sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)  # the one slot: admitted
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)  # held at admission, the engine step goes on
    assert sched.get_num_new_matched_tokens(plain, 0) == (0, False)  # a request without the marker is never held
    clock.t += STAGING_WAIT_S - 0.5
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)  # within the bound: still waiting

    worker._note_released("a")  # a's transfer ended (sent or failed): the worker gives its slot back ...
    meta = worker.build_connector_worker_meta()
    assert worker.build_connector_worker_meta() is None  # reported once
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))  # ... and the scheduler hears it
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)  # b takes the freed slot

    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)  # b holds it now (its node stalled)
    clock.t += STAGING_WAIT_S
    assert sched.get_num_new_matched_tokens(c, 0) == (0, False)  # past the bound: served without the hand-off
    _, params = sched.request_finished(c, [])
    handoff = params[RESULT_KEY]
    assert handoff["state"] == "refused" and handoff["transfer_id"] == "tx-c"
    assert "all 1 staging slots held by transfers in flight" in handoff["reason"]
    assert sched.events.snapshot()["refused"] == 1


def test_a_claim_that_ends_while_waiting_or_before_staging_holds_no_slot() -> None:
    sched = _connector(KVConnectorRole.SCHEDULER)
    sched._clock = _Clock()
    a, b = _request("a"), _request("b")
    sched.on_new_request(a)
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)
    sched.request_finished(a, [])  # aborted before any step staged it: the worker never took a slot
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)


def test_tensor_parallel_ranks_each_give_the_slot_back() -> None:
    sched = _connector(KVConnectorRole.SCHEDULER)
    sched._clock, sched._tp_size = _Clock(), 2
    a, b = _request("a"), _request("b")
    sched.on_new_request(a)
    sched.on_new_request(b)
    sched.get_num_new_matched_tokens(a, 0)
    rank0, rank1 = _connector(KVConnectorRole.WORKER), _connector(KVConnectorRole.WORKER)
    rank0._note_released("a")
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=rank0.build_connector_worker_meta()))
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)  # rank 1 still holds its share
    rank1._note_released("a")
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=rank1.build_connector_worker_meta()))
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)


def test_the_pool_refuses_an_unbounded_wait_and_times_out() -> None:
    pool = StagingPool(LAYOUT, 256, num_slots=1)
    held = pool.acquire()
    assert held is not None
    with pytest.raises(ValueError, match="bounded timeout"):
        pool.acquire(timeout=None)  # type: ignore[arg-type]
    assert pool.acquire(timeout=0.05) is None
    pool.release(held)
    assert pool.acquire(timeout=0.05) is not None
