"""The parity reference of the handoff tests: a stock vLLM per model, started once without any connector.

Issue 13 part 7 asks for parity against a separate stock vLLM, not only against an unmarked request on the
instance that loads the connector (which could hide a connector that changes vLLM's own output). It runs with
exactly the prefill's flags minus `--kv-transfer-config`, computes every case's greedy tokens, and stops before
the module's own vLLM starts (one vLLM at a time on the 2-core box).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from .cases import GEN_TOKENS, PROMPT_LENGTHS
from .stack import complete, prompt_ids, start_prefill

StockGreedy = Callable[..., dict[int, list[int]]]


@pytest.fixture(scope="session")
def stock_greedy(tmp_path_factory: pytest.TempPathFactory) -> StockGreedy:
    """(model_dir, extra vLLM args) -> {prompt length: stock vLLM's greedy tokens}, computed once per model."""
    cache: dict[tuple[str, tuple[str, ...]], dict[int, list[int]]] = {}

    def reference(model_dir: Path, extra: Sequence[str] = ()) -> dict[int, list[int]]:
        key = (str(model_dir), tuple(extra))
        if key not in cache:
            work = tmp_path_factory.mktemp("stock-vllm")
            vllm = start_prefill(model_dir, work / "vllm.log", None, extra=extra)
            try:
                assert "--kv-transfer-config" not in vllm.proc.args, vllm.proc.args  # stock: no connector at all
                cache[key] = {n: complete(vllm, str(model_dir), prompt_ids(n, seed=n), GEN_TOKENS)[0] for n in PROMPT_LENGTHS}
            finally:
                vllm.stop()
        return cache[key]

    return reference
