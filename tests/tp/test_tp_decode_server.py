"""A decode server with tp_size=2 on CPU as a real process: rank 0 serves HTTP and the control port, rank 1
is the worker process it starts. KV arrives through KVSender over tcp (from 1 or 2 prefill ranks) and the
tokens must equal what one rank decodes from the same state."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from tests.runtime.conftest import free_port, wire_payload
from tests.reserved import reserve_http
from tests.runtime.hf_engine import hf_prefill_kv
from tilepd.control.cache_layout import CacheLayout
from tilepd.control.sender import KVSender
from tilepd.engine import KVState, SamplingParams, load_engine
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, DecodeServerConfig, TransportConfig
from tilepd.transport import Buffer

pytestmark = pytest.mark.slow

MAX_SEQ = 256
N_TOKENS = 32
# CI runs these on CPU (gloo); TILEPD_TEST_DEVICE=cuda runs the same tests on a host with 2 GPUs (NCCL, CUDA
# graphs, fp32 so that 1 rank and 2 ranks compare exactly).
DEVICE = os.environ.get("TILEPD_TEST_DEVICE", "cpu")
ONE_RANK = {"device": "cuda:0", "dtype": "float32"} if DEVICE == "cuda" else {}
if DEVICE == "cuda" and torch.cuda.device_count() < 2:
    pytestmark = [pytest.mark.slow, pytest.mark.skip(reason="TILEPD_TEST_DEVICE=cuda needs 2 GPUs")]


class Node:
    def __init__(self, python: str, weights: Path, family: str, tmp: Path, tp_size: int, use_flags: bool = False) -> None:
        """From a DecodeServerConfig file as the plan renders it, or from the development flags (--tp-size)."""
        self.http_port, self.ctrl_port = free_port(), free_port()
        if use_flags:
            argv = [python, "-m", "tilepd.runtime", "--weights", str(weights), "--family", family, "--max-seq-len", str(MAX_SEQ),
                    "--http-port", str(self.http_port), "--ctrl-port", str(self.ctrl_port), "--tp-size", str(tp_size),
                    "--device", DEVICE, "--kv-cache-dtype", "float32"]
        else:
            cfg = DecodeServerConfig(name=f"tp{tp_size}", served_model_name="tiny", family=family, weights_dir=weights, max_seq_len=MAX_SEQ,
                                     device=DEVICE, kv_cache_dtype="float32", tp_size=tp_size, bind_host="127.0.0.1", advertise_host="127.0.0.1",
                                     http_port=self.http_port, ctrl_port=self.ctrl_port, transport=TransportConfig(name="tcp"), kv_timeout_s=10)
            (tmp / "decode.json").write_text(cfg.model_dump_json())
            argv = [python, "-m", "tilepd.runtime", "--config", str(tmp / "decode.json")]
        self.log = tmp / "decode.log"
        self.proc = subprocess.Popen(argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.fences: dict[str, int] = {}  # transfer id -> its reservation's fence
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"decode server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"decode server not healthy in 120 s:\n{self.log.read_text()[-3000:]}")

    def workers(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True) if "tilepd.engine.tp_worker" in " ".join(p.cmdline())]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def send(self, layout: CacheLayout, layers: list[torch.Tensor], tid: str, family: str, prefill_tp: int = 1) -> None:
        """What the connector does: each prefill rank sends its share of the heads on its own connection."""
        cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=self.ctrl_port, http_port=1),),
                                   transport=TransportConfig(name="tcp"), model_family=family, max_seq_len=MAX_SEQ)
        shard = layout.model_copy(update={"num_heads": layout.num_heads // prefill_tp})
        seq_len = layers[0].shape[0]
        nb = shard.blocks_for(seq_len)
        results = {}
        self.fences[tid] = reserve_http(self.url, tid, "tok")  # what the router does before the prefill (node API 2)

        def rank(r: int) -> None:
            h = shard.num_heads
            sender = KVSender(cfg, shard, Buffer.from_array(wire_payload([x[:, r * h:(r + 1) * h] for x in layers], shard)),
                              sender_rank=r, tp_size=prefill_tp)
            try:
                results[r] = sender.send(("127.0.0.1", self.ctrl_port), tid, "tok", seq_len, nb,
                                         [l * nb * shard.block_bytes for l in range(shard.num_layers)])
            finally:
                sender.close()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(prefill_tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == prefill_tp and all(res.ok for res in results.values()), results

    def decode(self, tid: str, first: int, seq_len: int) -> dict:
        r = httpx.post(self.url + "/v1/decode", timeout=120, json={
            "transfer_id": tid, "token": "tok", "fence": self.fences[tid], "first_token": first, "prompt_tokens": seq_len, "max_tokens": N_TOKENS,
            "ignore_eos": True, "stream": False})
        assert r.status_code == 200, r.text
        return r.json()


def _one_rank(weights: Path, layers: list[torch.Tensor], first: int, **kw) -> list[int]:
    eng = load_engine(weights, max_seq_len=MAX_SEQ, **ONE_RANK, **kw)
    eng.inject(KVState(layers[0].shape[0], layers))
    return eng.decode(first, N_TOKENS, SamplingParams(ignore_eos=True), lambda t: None).tokens


def test_llama_tp2_node_matches_one_rank(python_exe: str, tiny_llama: Path, tp_llama: dict[int, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32).eval()
    prompt = [(i * 7) % 300 + 5 for i in range(40)]
    first, layers = hf_prefill_kv(hf, prompt)
    want = _one_rank(tp_llama[1], layers, first)
    c = hf.config
    hd = c.hidden_size // c.num_attention_heads
    layout = CacheLayout(kind="attn", num_layers=c.num_hidden_layers, block_size=16, num_heads=c.num_key_value_heads,
                         entry_width=2 * hd, dtype="float32", order="BHNC", head_size_k=hd, head_size_v=hd)
    node = Node(python_exe, tp_llama[2], "llama", tmp_path, tp_size=2)
    try:
        workers = node.workers()
        assert len(workers) == 1
        caps = httpx.get(node.url + "/capabilities").json()
        assert caps["tp_size"] == 2 and caps["sampling"]["tensor_parallel"] is True
        for prefill_tp in (1, 2):  # prefill TP 1 -> decode TP 2, and prefill TP 2 -> decode TP 2
            node.send(layout, layers, f"tx-p{prefill_tp}", "llama", prefill_tp)
            out = node.decode(f"tx-p{prefill_tp}", first, len(prompt))
            assert out["tokens"] == want, f"prefill tp {prefill_tp}"
        workers[0].kill()  # a rank that dies (a crash cannot be produced on demand): the node says so
        deadline = time.monotonic() + 10
        while (health := httpx.get(node.url + "/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health.status_code == 503 and "rank 1 (exit -9)" in health.json()["reason"]
    finally:
        node.stop()


def test_deepseek_tp2_node_matches_one_rank(python_exe: str, tp_deepseek: dict[int, Path], tmp_path: Path) -> None:
    """MLA: the latent arrives once (prefill rank 0) and every decode rank holds all of it."""
    eng = load_engine(tp_deepseek[1], max_seq_len=MAX_SEQ, num_speculative_tokens=0, **ONE_RANK)
    s = eng.config
    width = s.kv_lora_rank + s.qk_rope_head_dim
    eng.inject(KVState(1, [torch.zeros(1, 1, width) for _ in eng.model.caches]))
    gen = eng.decode(7, 30, SamplingParams(ignore_eos=True), lambda t: None).tokens
    seq_len = eng.seq_len
    prefix = [c[:seq_len].cpu().clone() for c in eng.model.caches]
    want = eng.decode(gen[-1], N_TOKENS, SamplingParams(ignore_eos=True), lambda t: None).tokens
    layout = CacheLayout(kind="mla", num_layers=len(prefix), block_size=16, num_heads=1, entry_width=width, dtype="float32",
                         kv_lora_rank=s.kv_lora_rank, rope_dim=s.qk_rope_head_dim)
    node = Node(python_exe, tp_deepseek[2], "deepseek_v3", tmp_path, tp_size=2, use_flags=True)
    try:
        workers = node.workers()
        node.send(layout, prefix, "tx-mla", "deepseek_v3")
        assert node.decode("tx-mla", gen[-1], seq_len)["tokens"] == want
    finally:
        node.stop()
    assert "event=tp_rank_exit" not in node.log.read_text(), "rank 1 was not stopped by rank 0"
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert len(gone) == 1 and not alive, "the worker rank outlived the server"
