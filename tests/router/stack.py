"""Real processes for the router tests and bench: vLLM prefill (tilepd connector, optionally with
the stock NixlConnector under MultiConnector), a native vLLM decode (NixlConnector consumer),
tilepd decode nodes, and the router itself. Each is its own process group; `stop()` ends it."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.waiting import wait_until  # noqa: F401 - the router tests import it from here
from tilepd.plan.vllm_args import nixl_config
from tilepd.connector.launch import Server, free_port, kv_transfer_config, multi_with_nixl, start_process, start_vllm
from tilepd.contracts.service_configs import (
    ConnectorExtraConfig,
    DecodeEndpoint,
    DecodeServerConfig,
    DivergenceWatchConfig,
    NativePoolConfig,
    RouterConfig,
    RoutingConfig,
    TransportConfig,
)

MODEL_NAME = "tiny-llama"
TOOL_CALL_PARSER = "hermes"  # the prefill is also "vLLM alone" for tool calls (test_agents_tools.py)
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", TOOL_CALL_PARSER]
MAX_SEQ_LEN = 1024
VLLM_ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0", "--max-model-len", str(MAX_SEQ_LEN),
             "--served-model-name", MODEL_NAME, "--enforce-eager", *TOOL_ARGS]
NIXL_CONSUMER = nixl_config("kv_consumer", cpu=True)  # what the planner renders for a CPU native decode


def spare_endpoint(name: str) -> DecodeEndpoint:
    """Ports for a decode node started later (the prefill's allowlist is fixed when vLLM starts)."""
    return DecodeEndpoint(name=name, host="127.0.0.1", ctrl_port=free_port(), http_port=free_port())


def start_decode_node(model_dir: Path, workdir: Path, name: str = "d0", *, kv_timeout_s: float = 30.0,
                      endpoint: DecodeEndpoint | None = None, env: dict[str, str] | None = None,
                      reservation_lease_s: float = 10.0) -> tuple[Server, DecodeEndpoint]:
    """A CPU decode node; on `endpoint`'s ports when given (a restart keeps its place in the allowlist); `env` adds
    to its environment (a test-only fault, tilepd.runtime.faults)."""
    ep = endpoint or spare_endpoint(name)
    cfg = DecodeServerConfig(
        name=ep.name, served_model_name=MODEL_NAME, family="llama", weights_dir=model_dir, max_seq_len=MAX_SEQ_LEN, device="cpu",
        bind_host="127.0.0.1", advertise_host="127.0.0.1", http_port=ep.http_port, ctrl_port=ep.ctrl_port,
        transport=TransportConfig(name="tcp", data_port=free_port()), kv_timeout_s=kv_timeout_s, cuda_graphs=False,
        kv_cache_dtype="float32", reservation_lease_s=reservation_lease_s,
    )
    path = workdir / f"{ep.name}.json"
    path.write_text(cfg.model_dump_json())
    srv = start_process([sys.executable, "-m", "tilepd.runtime", "--config", str(path)], workdir / f"{ep.name}.log",
                        f"http://127.0.0.1:{cfg.http_port}/health", timeout=300, env=env)
    return srv, ep


def connector_extra(endpoints: Sequence[DecodeEndpoint], otlp_endpoint: str | None = None) -> ConnectorExtraConfig:
    return ConnectorExtraConfig(decode_allowlist=tuple(endpoints), transport=TransportConfig(name="tcp"), model_family="llama",
                                max_seq_len=MAX_SEQ_LEN, connect_timeout_s=2.0, otlp_endpoint=otlp_endpoint)


def start_prefill(model_dir: Path, workdir: Path, endpoints: Sequence[DecodeEndpoint], *, with_nixl: bool,
                  otlp_endpoint: str | None = None) -> Server:
    """vLLM prefill: the tilepd connector for marked requests, plus NixlConnector (kv_producer) for the native pool."""
    extra = connector_extra(endpoints, otlp_endpoint)
    kv = multi_with_nixl(extra) if with_nixl else kv_transfer_config(extra)
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), **cpu_bind("prefill")}
    return start_vllm(model_dir, workdir / "prefill.log", kv_config=kv, extra_args=VLLM_ARGS, env=env)


def cpu_bind(role: str) -> dict[str, str]:
    """Disjoint cores for the two vLLM instances of this stack. vLLM's CPU platform binds each worker (and the
    threads it starts, NIXL's busy UCX progress thread among them) to the same core when left on 'auto': the
    native decode's worker then got 3 s of CPU in 2 min beside the prefill's spinning progress thread and never
    finished starting (issue 13 part 8; py-spy showed it importing torch._dynamo, affinity core 0 for both)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[0] if role == "prefill" else cores[1])}


def start_native_decode(model_dir: Path, workdir: Path) -> Server:
    """vLLM decode with NixlConnector (kv_consumer).

    The prefill runs MultiConnector with a child that lacks hybrid-KV-cache-manager support,
    so vLLM turns HMA off there; NIXL's handshake hashes that flag, so the decode must turn
    it off too or every transfer fails with "NIXL compatibility hash mismatch".

    One bounded retry: beside a NIXL prefill on a 2-core box its worker once never finished initialising (no log
    line after the OpenMP binding for 10 min, 13 s of CPU, while the prefill's UCX progress thread spun a core;
    issue 13 part 8). A normal start takes well under a minute, so the first try is cut at 300 s.
    """
    errors: list[str] = []
    for attempt in (1, 2):
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), **cpu_bind("native")}
        log = workdir / ("native-decode.log" if attempt == 1 else f"native-decode-{attempt}.log")
        try:
            return start_vllm(model_dir, log, kv_config=NIXL_CONSUMER, timeout=300.0,
                              extra_args=[*VLLM_ARGS, "--disable-hybrid-kv-cache-manager"], env=env)
        except RuntimeError as e:
            errors.append(str(e)[:2000])
            print(f"native vLLM decode start {attempt} failed, log {log}", file=sys.stderr)
    raise RuntimeError("native vLLM decode did not start in 2 tries:\n" + "\n---\n".join(errors))


def router_config(model_dir: Path, prefill_url: str, endpoints: Sequence[DecodeEndpoint], *, native: tuple[str, str] | None = None,
                  **overrides: Any) -> RouterConfig:
    fields: dict[str, Any] = dict(
        bind_host="127.0.0.1", port=free_port(), served_model_name=MODEL_NAME, tokenizer_dir=model_dir,
        prefill_urls=(prefill_url,), decode_nodes=tuple(endpoints), queue_timeout_s=2.0, health_interval_s=0.5,
        native_pool=NativePoolConfig(prefill_urls=(native[0],), decode_urls=(native[1],)) if native else None,
        routing=RoutingConfig(by_model={f"{MODEL_NAME}-native": "native"} if native else {}),
        # off unless a test asks for it: its probes hold a node for a moment, which the package's long-lived routers
        # would do at odd times in other modules' tests (tests/router/test_fingerprint_divergence.py turns it on)
        divergence_watch=DivergenceWatchConfig(enabled=False),
    )
    fields.update(overrides)
    return RouterConfig(**fields)


def start_router(config: RouterConfig, workdir: Path, name: str = "router", env: dict[str, str] | None = None) -> Server:
    path = workdir / f"{name}.json"
    path.write_text(config.model_dump_json())
    return start_process([sys.executable, "-m", "tilepd.router", "--config", str(path)], workdir / f"{name}.log",
                         f"http://127.0.0.1:{config.port}/health", timeout=120, env=env)


def stop_all(servers: Sequence[Server]) -> None:
    for srv in reversed(servers):
        try:
            srv.stop()
        except Exception:  # noqa: BLE001 - stop the others anyway
            pass


