"""Shared prompt cases for the vLLM handoff tests: the greedy-equality check per prompt."""

from __future__ import annotations

import time
from typing import Any

from .stack import DecodeNode, complete, events, handoff, prompt_ids
from tilepd.connector.launch import Server

# vLLM runs with --max-num-batched-tokens 256, llama's kernel block is 128 tokens (MLA: 16):
# short, one block minus/exactly/plus one, and three that span several prefill steps (chunked).
PROMPT_LENGTHS = (5, 64, 127, 128, 129, 300, 700, 1500)
GEN_TOKENS = 32  # issue 13 part 7: at least 32 greedy tokens per prompt equal vLLM's own


def wait_event(server: Server, event: str, transfer_id: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(server):
            if e.get("event") == event and e.get("transfer_id") == transfer_id:
                return e
        time.sleep(0.2)
    raise AssertionError(f"no {event} event for {transfer_id} in {server.log_path}")


def check_greedy_equal(vllm: Server, model: str, node: DecodeNode, n_prompt: int, tag: str,
                       stock: dict[int, list[int]] | None = None) -> dict[str, Any]:
    """Prefill+handoff+decode gives exactly vLLM's own greedy tokens: those of a separate stock vLLM without any
    connector (`stock`, conftest.py) and of an unmarked request on this instance; returns the connector's `sent`."""
    ids = prompt_ids(n_prompt, seed=n_prompt)
    want, _ = complete(vllm, model, ids, GEN_TOKENS)  # unmarked: the connector does nothing for it
    if stock is not None and n_prompt in stock:
        assert want == stock[n_prompt], f"prompt of {n_prompt} tokens: vLLM with the connector gave {want} unmarked, stock vLLM {stock[n_prompt]}"
    tid = f"{tag}-{n_prompt}"
    got = handoff(vllm, model, node, ids, GEN_TOKENS, tid)
    assert got == want, f"prompt of {n_prompt} tokens: handoff gave {got}, vLLM alone {want}"
    return wait_event(vllm, "sent", tid)
