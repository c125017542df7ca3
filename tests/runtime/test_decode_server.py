"""The decode server as a real process: KV in over the control protocol, tokens out over HTTP.

KV states come from HF transformers' prefill of the same tiny Llama (what vLLM's
prefill computes), packed in vLLM's block layout; the decoded tokens must equal
HF's own greedy continuation.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.reserved import reserve_http
from tests.runtime.hf_engine import hf_greedy, hf_prefill_kv
from tests.runtime.conftest import start_node, stop_node, wire_payload
from tilepd.control.messages import PROTOCOL_VERSION
from tilepd.control.cache_layout import CacheLayout
from tilepd.control.sender import KVSender
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig
from tilepd.transport import Buffer

pytestmark = pytest.mark.slow

PROMPTS = {
    "short": [5, 17, 42],
    "one_block": list(range(20, 36)),  # exactly one 16-token block
    "multi_block": [(i * 7) % 300 + 5 for i in range(70)],
}


def _layout(model, block_size: int = 16, order: str = "BHNC", dtype: str = "float32") -> CacheLayout:
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    return CacheLayout(kind="attn", num_layers=c.num_hidden_layers, block_size=block_size, num_heads=c.num_key_value_heads,
                       entry_width=2 * hd, dtype=dtype, order=order, head_size_k=hd, head_size_v=hd)


_fences: dict[str, int] = {}  # transfer id -> its reservation's fence (each test here reserves its ids once)


def _reserve(node, tid: str, token: str = "tok", headers: dict[str, str] | None = None) -> int:
    """What the router does before the prefill (node API 2): reserve the slot for `tid` (`headers`: the router's key)."""
    _fences[tid] = reserve_http(node.http, tid, token, headers)
    return _fences[tid]


def _handoff(node, model, prompt, tid, *, transport="tcp", layout=None, token="tok", headers=None, reserve=True):
    """Reserve the slot (unless `tid` holds it already, or `reserve` is False), prefill with HF, send the KV like the
    connector does; returns the first token."""
    if reserve and httpx.get(node.http + "/status", timeout=30).json()["transfer_id"] != tid:
        _reserve(node, tid, token, headers)
    layout = layout or _layout(model)
    first, layers = hf_prefill_kv(model, prompt)
    staging = wire_payload(layers, layout)
    cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=node.ctrl_port, http_port=1),),
                               transport=TransportConfig(name=transport), model_family="llama", max_seq_len=512)
    sender = KVSender(cfg, layout, Buffer.from_array(staging))
    nb = layout.blocks_for(len(prompt))
    try:
        r = sender.send(("127.0.0.1", node.ctrl_port), tid, token, len(prompt), nb,
                        [l * nb * layout.block_bytes for l in range(layout.num_layers)])
    finally:
        sender.close()
    assert r.ok, r
    return first


def _tokens(r) -> list[int]:
    """The decoded tokens of a 200 answer; any other answer fails with its body (the node's reason)."""
    assert r.status_code == 200, f"{r.status_code} {r.text}"
    return r.json()["tokens"]


def _body(tid, first, prompt, **kw):
    """A decode request naming its reservation's fence (0 for an id no test reserved: refused before the slot, or not_reserved)."""
    return {"transfer_id": tid, "token": "tok", "fence": _fences.get(tid, 0), "first_token": first, "prompt_tokens": len(prompt),
            "max_tokens": 8, "ignore_eos": True, "stream": False, **kw}


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_decode_matches_hf_greedy(llama_node, hf_llama, name) -> None:
    prompt = PROMPTS[name]
    first = _handoff(llama_node, hf_llama, prompt, f"tx-{name}")
    with llama_node.client() as c:
        r = c.post("/v1/decode", json=_body(f"tx-{name}", first, prompt))
    assert r.status_code == 200, r.text
    ref = hf_greedy(hf_llama, prompt, 9)
    assert [first] + _tokens(r) == ref
    assert r.json()["finish_reason"] == "length" and r.json()["completion_tokens"] == 8


@pytest.mark.parametrize("order,block_size", [("BNHC", 16), ("BHNC", 128)])
def test_other_orders_and_block_sizes(llama_node, hf_llama, order, block_size) -> None:
    prompt = PROMPTS["multi_block"]
    tid = f"tx-{order}-{block_size}"
    first = _handoff(llama_node, hf_llama, prompt, tid, layout=_layout(hf_llama, block_size, order))
    with llama_node.client() as c:
        r = c.post("/v1/decode", json=_body(tid, first, prompt))
    assert [first] + _tokens(r) == hf_greedy(hf_llama, prompt, 9)


def test_decode_request_first_then_kv_streams_ndjson(llama_node, hf_llama) -> None:
    """The decode request joins the reservation and waits; the KV arrives afterwards; tokens stream."""
    prompt = PROMPTS["multi_block"]
    first, _ = hf_prefill_kv(hf_llama, prompt)
    lines: list[dict] = []
    _reserve(llama_node, "tx-stream")

    def client() -> None:
        with llama_node.client() as c, c.stream("POST", "/v1/decode", json=_body("tx-stream", first, prompt, stream=True)) as r:
            assert r.headers["content-type"].startswith("application/x-ndjson")
            lines.extend(json.loads(line) for line in r.iter_lines() if line)

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 10
    with llama_node.client() as c:
        while not c.get("/status").json()["decode_joined"] and time.monotonic() < deadline:
            time.sleep(0.02)
    _handoff(llama_node, hf_llama, prompt, "tx-stream")
    t.join(30)
    assert [x["token"] for x in lines[:-1]] == hf_greedy(hf_llama, prompt, 9)[1:]
    assert lines[-1]["done"] and lines[-1]["finish_reason"] == "length" and "decode_ms" in lines[-1]["timings"]


def test_kv_that_never_arrives_answers_504_and_frees_the_slot(llama_node) -> None:
    _reserve(llama_node, "tx-lost")
    with llama_node.client() as c:
        t = time.monotonic()
        r = c.post("/v1/decode", json=_body("tx-lost", 1, [1, 2, 3], kv_timeout_s=0.5))
        assert r.status_code == 504 and r.json()["error"]["code"] == "kv_timeout"
        assert time.monotonic() - t < 10
        assert c.get("/status").json()["state"] == "free"


def test_busy_token_mismatch_and_parameter_errors(llama_node, hf_llama) -> None:
    _reserve(llama_node, "tx-hold")
    with llama_node.client() as c:
        holder = threading.Thread(target=c.post, args=("/v1/decode",), kwargs={"json": _body("tx-hold", 1, [1, 2], kv_timeout_s=15)})
        holder.start()
        deadline = time.monotonic() + 10
        while c.get("/status").json()["transfer_id"] != "tx-hold" and time.monotonic() < deadline:
            time.sleep(0.02)
        busy = c.post("/v1/decode", json=_body("tx-other", 1, [1, 2]))
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == "busy"
        taken = c.post("/v1/reserve", json={"transfer_id": "tx-other", "token": "tok", "holder": "router-b", "node_api": 2})
        assert taken.status_code == 429 and taken.json()["error"]["code"] == "busy" and taken.json()["error"]["holder"] == "test"
        older = c.post("/v1/decode", json={k: v for k, v in _body("tx-other", 1, [1, 2]).items() if k != "fence"})
        assert older.status_code == 426 and older.json()["error"]["code"] == "node_api_mismatch", older.text
        assert "upgrade the router" in older.json()["error"]["message"]
        mismatch = c.post("/v1/decode", json={**_body("tx-hold", 1, [1, 2]), "token": "wrong"})
        assert mismatch.status_code == 409 and mismatch.json()["error"]["code"] == "bad_token"
        holder.join(25)  # the hold lasts its kv_timeout_s (15 s: long enough for a loaded 2-core box to ask twice)
        unknown = c.post("/v1/decode", json={**_body("t", 1, [1]), "best_of": 3})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "best_of"
        bad = c.post("/v1/decode", json={**_body("t", 1, [1]), "top_p": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
        long = c.post("/v1/decode", json={**_body("t", 1, [1]), "max_tokens": 10_000})
        assert long.status_code == 400 and long.json()["error"]["param"] == "max_tokens"
        nope = c.post("/v1/decode", json={**_body("t", 1, [1]), "presence_penalty": 0.5})
        assert nope.status_code == 501 and nope.json()["error"]["param"] == "presence_penalty"
        many = c.post("/v1/decode", json={**_body("t", 1, [1]), "top_logprobs": 21})  # the engine's top_logprobs_max is 20
        assert many.status_code == 400 and many.json()["error"]["param"] == "top_logprobs"
        assert c.get("/status").json()["state"] == "free"


def test_kv_that_does_not_hash_as_staged_is_never_decoded(llama_node, hf_llama, monkeypatch) -> None:
    """Fault injection: a sender whose digest of layer 0 disagrees with the bytes it wrote (the stand-in for bytes
    damaged on the way; the real transport cannot corrupt on demand). The decode request fails with 502
    kv_checksum_mismatch before any token, the node logs it, and it serves the next request normally."""
    real = KVSender._digests

    def corrupt(self, plan, src):
        d = real(self, plan, src)
        d[0] = f"{int(d[0], 16) ^ 1:016x}"
        return d

    prompt = PROMPTS["multi_block"]
    result: dict = {}
    _reserve(llama_node, "tx-sum")

    def request() -> None:
        with llama_node.client() as c2:
            result["r"] = c2.post("/v1/decode", json=_body("tx-sum", 1, prompt))

    with llama_node.client() as c:
        t = threading.Thread(target=request)
        t.start()
        deadline = time.monotonic() + 10  # the decode request waits for the KV (a late one: test_slot's failure test)
        while not c.get("/status").json()["decode_joined"] and time.monotonic() < deadline:
            time.sleep(0.02)
        monkeypatch.setattr(KVSender, "_digests", corrupt)
        layout = _layout(hf_llama)
        _, layers = hf_prefill_kv(hf_llama, prompt)
        staging = wire_payload(layers, layout)
        cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=llama_node.ctrl_port, http_port=1),),
                                   transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=512)
        sender = KVSender(cfg, layout, Buffer.from_array(staging))
        nb = layout.blocks_for(len(prompt))
        try:
            sent = sender.send(("127.0.0.1", llama_node.ctrl_port), "tx-sum", "tok", len(prompt), nb,
                               [l * nb * layout.block_bytes for l in range(layout.num_layers)])
        finally:
            sender.close()
        monkeypatch.undo()
        t.join(30)
        assert not sent.ok and sent.code == "kv_checksum_mismatch", sent
        r = result["r"]
        assert r.status_code == 502 and r.json()["error"]["code"] == "kv_checksum_mismatch", r.text
        assert "layer 0" in r.json()["error"]["message"]
        assert "event=kv_checksum_mismatch" in llama_node.log.read_text()
        assert c.get("/status").json()["state"] == "free"
    first = _handoff(llama_node, hf_llama, prompt, "tx-after")
    with llama_node.client() as c:
        ok = c.post("/v1/decode", json=_body("tx-after", first, prompt))
    assert ok.status_code == 200 and [first] + _tokens(ok) == hf_greedy(hf_llama, prompt, 9)


def test_cancel_stops_a_running_decode(llama_node, hf_llama) -> None:
    prompt = PROMPTS["short"]
    first = _handoff(llama_node, hf_llama, prompt, "tx-cancel")
    lines: list[dict] = []
    with llama_node.client() as c, c.stream("POST", "/v1/decode", json=_body("tx-cancel", first, prompt, stream=True, max_tokens=400)) as r:
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(json.loads(line))
            if len(lines) == 3:
                with llama_node.client() as c2:
                    assert c2.post("/v1/cancel", json={"transfer_id": "tx-cancel"}).json()["cancelled"] is True
    assert lines[-1]["done"] and lines[-1]["finish_reason"] == "cancelled"
    assert lines[-1]["completion_tokens"] < 400
    with llama_node.client() as c:
        assert c.get("/status").json()["state"] == "free"


def test_status_metrics_capabilities(llama_node, hf_llama) -> None:
    prompt = PROMPTS["short"]
    first = _handoff(llama_node, hf_llama, prompt, "tx-metrics")
    with llama_node.client() as c:
        assert c.post("/v1/decode", json=_body("tx-metrics", first, prompt)).status_code == 200
        st = c.get("/status").json()
        assert st["state"] == "free" and st["transfers_total"] >= 1 and st["last"]["tokens"] == 8
        assert {"wait_ms", "convert_ms", "inject_ms", "decode_ms", "tokens_per_s"} <= set(st["last"])
        caps = c.get("/capabilities").json()
        assert caps["protocol_version"] == PROTOCOL_VERSION and caps["transport"] == "tcp" and caps["layout"]["num_heads"] == 2
        m = c.get("/metrics").text
        for name in ("tilepd_decode_transfers_total", "tilepd_decode_transfer_bytes_total", "tilepd_decode_kv_wait_seconds_count",
                     "tilepd_decode_convert_seconds_count", "tilepd_decode_inject_seconds_count",
                     "tilepd_decode_decode_seconds_count", "tilepd_decode_tokens_per_second"):
            assert name in m
        # the stall watch ticks on the live node's event loop (tilepd.runtime.stall_watch)
        [lag_count] = [line.split()[-1] for line in m.splitlines() if line.startswith("tilepd_decode_loop_lag_seconds_count")]
        assert float(lag_count) >= 1, m
    log = llama_node.log.with_suffix(".file.log").read_text()  # the config's log_file
    assert "event=complete transfer_id=tx-metrics" in log and "event=decode_done transfer_id=tx-metrics" in log


def test_nixl_handoff_matches_hf_greedy(python_exe, tiny_llama, hf_llama, tmp_path) -> None:
    node = start_node(python_exe, tiny_llama, tmp_path, transport="nixl")
    try:
        prompt = PROMPTS["multi_block"]
        first = _handoff(node, hf_llama, prompt, "tx-nixl", transport="nixl")
        with node.client() as c:
            r = c.post("/v1/decode", json=_body("tx-nixl", first, prompt))
        assert [first] + _tokens(r) == hf_greedy(hf_llama, prompt, 9)
    finally:
        stop_node(node)


def test_mla_latent_handoff_into_deepseek_node(python_exe, tiny_deepseek, tmp_path) -> None:
    """MLA: a latent cache produced by one tilepd engine travels in vLLM's block layout into the node's engine.

    Engine A (in this process) decodes a sequence; its latent cache for that prefix is packed as vLLM's
    MLA cache ([blocks, 1, 16, 576]), sent over tcp, and the node must continue exactly as engine A does.
    """
    import torch

    from tilepd.engine import KVState, SamplingParams, load_engine

    eng = load_engine(tiny_deepseek, device="cpu", max_seq_len=512, num_speculative_tokens=0)
    width = eng.config.kv_lora_rank + eng.config.qk_rope_head_dim
    eng.inject(KVState(seq_len=1, layers=[torch.zeros(1, 1, width) for _ in eng.model.caches]))
    gen = eng.decode(7, 40, SamplingParams(ignore_eos=True), lambda t: None).tokens
    seq_len = eng.seq_len
    prefix = [c[:seq_len].clone() for c in eng.model.caches]
    ref = eng.decode(gen[-1], 8, SamplingParams(ignore_eos=True), lambda t: None).tokens

    layout = CacheLayout(kind="mla", num_layers=len(prefix), block_size=16, num_heads=1, entry_width=width, dtype="float32",
                         kv_lora_rank=eng.config.kv_lora_rank, rope_dim=eng.config.qk_rope_head_dim)
    staging = wire_payload(prefix, layout)
    node = start_node(python_exe, tiny_deepseek, tmp_path, family="deepseek_v3")
    try:
        cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=node.ctrl_port, http_port=1),),
                                   transport=TransportConfig(name="tcp"), model_family="deepseek_v3", max_seq_len=512)
        _reserve(node, "tx-mla")
        sender = KVSender(cfg, layout, Buffer.from_array(staging))
        nb = layout.blocks_for(seq_len)
        r = sender.send(("127.0.0.1", node.ctrl_port), "tx-mla", "tok", seq_len, nb,
                        [l * nb * layout.block_bytes for l in range(layout.num_layers)])
        sender.close()
        assert r.ok, r
        with node.client() as c:
            out = c.post("/v1/decode", json={"transfer_id": "tx-mla", "token": "tok", "fence": _fences["tx-mla"], "first_token": gen[-1],
                                             "prompt_tokens": seq_len, "max_tokens": 8, "ignore_eos": True, "stream": False})
        assert out.status_code == 200, out.text
        assert out.json()["tokens"] == ref
    finally:
        stop_node(node)


def test_prefill_tensor_parallel_ranks_each_send_their_heads(llama_node, hf_llama) -> None:
    """TP=2 prefill: each rank holds one of the two KV heads and sends it on its own connection, at the same
    time; the node waits for both ranks and decodes exactly as HF does."""
    prompt = PROMPTS["multi_block"]
    first, layers = hf_prefill_kv(hf_llama, prompt)
    full = _layout(hf_llama)
    shard = full.model_copy(update={"num_heads": 1})
    cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=llama_node.ctrl_port, http_port=1),),
                               transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=512)
    nb = shard.blocks_for(len(prompt))
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        staging = wire_payload([x[:, r:r + 1, :] for x in layers], shard)
        sender = KVSender(cfg, shard, Buffer.from_array(staging), sender_rank=r, tp_size=2)
        results[r] = sender.send(("127.0.0.1", llama_node.ctrl_port), "tx-tp2", "tok", len(prompt), nb,
                                 [l * nb * shard.block_bytes for l in range(shard.num_layers)])
        sender.close()

    _reserve(llama_node, "tx-tp2")
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(res.ok for res in results.values()), results
    with llama_node.client() as c:
        r = c.post("/v1/decode", json=_body("tx-tp2", first, prompt))
    assert [first] + _tokens(r) == hf_greedy(hf_llama, prompt, 9)


def test_prefill_tp_rank_that_never_sends_fails_the_transfer(llama_node, hf_llama) -> None:
    """One rank of two sends; the other never does: the decode request times out (504) and the slot frees."""
    prompt = PROMPTS["short"]
    first, layers = hf_prefill_kv(hf_llama, prompt)
    shard = _layout(hf_llama).model_copy(update={"num_heads": 1})
    cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=llama_node.ctrl_port, http_port=1),),
                               transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=512)
    staging = wire_payload([x[:, :1, :] for x in layers], shard)
    sender = KVSender(cfg, shard, Buffer.from_array(staging), sender_rank=0, tp_size=2)
    _reserve(llama_node, "tx-half")
    assert sender.send(("127.0.0.1", llama_node.ctrl_port), "tx-half", "tok", len(prompt), 1, [0, shard.block_bytes]).ok
    sender.close()
    with llama_node.client() as c:
        r = c.post("/v1/decode", json=_body("tx-half", first, prompt, kv_timeout_s=0.5))
        assert r.status_code == 504
        assert c.get("/status").json()["state"] == "free"
