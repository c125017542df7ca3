"""Configuration files the plan renders for tilepd's own processes (INTERFACES §6).

These models are the contract between the planner (which writes them) and the
processes that read them at startup (decode server, router, vLLM connector). Keeping
them in one module means a field cannot be renamed on one side only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TransportName = Literal["tcp", "nixl", "mooncake"]
PoolName = Literal["low_latency", "native"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TransportConfig(_Strict):
    """How KV bytes travel from prefill to decode."""

    name: TransportName
    # tcp: the decode node's data port (the receiver listens there)
    data_port: int | None = None
    # nixl: UCX devices, e.g. "mlx5_0:1,mlx5_1:1"; None lets UCX choose
    ucx_net_devices: str | None = None
    # mooncake: "rdma" or "tcp"; device names for RDMA
    mooncake_protocol: Literal["rdma", "tcp"] = "rdma"
    mooncake_devices: str | None = None


class DecodeEndpoint(_Strict):
    """One decode node as the connector and the router see it."""

    name: str
    host: str
    ctrl_port: int
    http_port: int


class DecodeServerConfig(_Strict):
    """Read by `python -m tilepd.runtime --config FILE`."""

    name: str
    served_model_name: str
    family: str
    weights_dir: Path
    max_seq_len: int = Field(gt=0)
    kv_cache_dtype: str = "auto"
    device: Literal["cpu", "cuda"] = "cuda"
    tp_size: int = Field(default=1, ge=1)
    bind_host: str = "0.0.0.0"
    advertise_host: str
    http_port: int
    ctrl_port: int
    transport: TransportConfig
    recv_buffer: Literal["dram", "vram"] = "dram"
    num_speculative_tokens: int = Field(default=0, ge=0)
    kv_timeout_s: float = Field(default=30.0, gt=0)
    cuda_graphs: bool = True
    # prefill host addresses allowed to open the control channel; empty = any
    allowed_senders: tuple[str, ...] = ()
    # the deployment secret (tilepd.auth): None = unauthenticated (dev runs; the node warns at start)
    secret_file: Path | None = None
    log_file: Path | None = None
    # OpenTelemetry collector (OTLP/HTTP): the node's phases as spans in the router's trace (tilepd/runtime/tracing.py); off when None
    otlp_endpoint: str | None = Field(default=None, min_length=1, max_length=500)
    # the node's drained state across restarts: /admin/drain writes this file, /admin/undrain removes it, and a node
    # that starts while it exists starts draining (a drained node that crashes or is restarted stays out of rotation)
    drain_file: Path | None = None
    # a router's reservation of the slot lives this long past its last renewal (the router renews every quarter of
    # it): a router that dies frees the node within this, cancelling the decode it left (tilepd/runtime/reservations.py)
    reservation_lease_s: float = Field(default=10.0, ge=1.0, le=120.0)


class ConnectorExtraConfig(_Strict):
    """`kv_connector_extra_config` of the tilepd connector inside vLLM."""

    decode_allowlist: tuple[DecodeEndpoint, ...]
    transport: TransportConfig
    model_family: str
    max_seq_len: int = Field(gt=0)
    busy_retries: int = Field(default=20, ge=0)
    busy_backoff_s: float = Field(default=0.05, gt=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    # requests whose KV can be staged / in flight at once (each slot holds max_seq_len tokens)
    staging_slots: int = Field(default=2, ge=1)
    # OpenTelemetry collector (topology `router.otlp_endpoint`): the worker exports each hand-off's spans there
    otlp_endpoint: str | None = Field(default=None, min_length=1, max_length=500)


class NativePoolConfig(_Strict):
    """Stock vLLM P/D path: prefill with do_remote_decode, then a vLLM decode instance."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]


class RoutingConfig(_Strict):
    default_pool: PoolName = "low_latency"
    # a request header whose value names the pool ("low_latency" or "native")
    header: str = "x-tilepd-latency-class"
    # served model name -> pool
    by_model: dict[str, PoolName] = Field(default_factory=dict)
    # when the low-latency engine cannot honour a request, or every node stays busy
    fallback_to_native: bool = True


class PromptRenderConfig(_Strict):
    """The router's chat-template rendering (tilepd/router/render_pool.py): which `chat_template_kwargs` a client may
    pass (any other key, `chat_template` always, is refused with a 400), and the bounds of one render."""

    # keys a model's own template reads for a switch the client may flip; an operator adds their template's own
    allowed_template_kwargs: tuple[str, ...] = ("enable_thinking", "thinking", "reasoning_effort")
    workers: int = Field(default=2, ge=1, le=64)
    timeout_s: float = Field(default=5.0, gt=0)
    memory_mb: int = Field(default=1024, ge=64)


class DivergenceWatchConfig(_Strict):
    """The router's live divergence watch (tilepd/router/divergence_watch.py): greedy low-latency requests, a
    `sample_rate` share of them and a probe of each idle node every `interval_s`, scored by the prefill pool
    (teacher-forced, tilepd.contracts.teacher_forced); a node with `diverged_checks` diverged checks in a row is
    drained with the reason. The checks run off the request path."""

    enabled: bool = True
    sample_rate: float = Field(default=0.01, ge=0.0, le=1.0)
    interval_s: float = Field(default=60.0, gt=0)
    margin_nats: float = Field(default=1.0, ge=0.0)
    diverged_checks: int = Field(default=2, ge=1)
    probe_tokens: int = Field(default=16, ge=2, le=256)
    # a sampled request is scored over prompt + at most max_checked_tokens of its tokens, and only when that fits
    # max_context_tokens (prompt logprobs cost the prefill a full pass over the prompt)
    max_checked_tokens: int = Field(default=64, ge=1)
    max_context_tokens: int = Field(default=4096, ge=2)
    queue_size: int = Field(default=16, ge=1, le=1024)


class RouterConfig(_Strict):
    """Read by `python -m tilepd.router --config FILE`."""

    # the router's name in the topology: with its host, port and pid, who holds a node's slot (another router is told)
    name: str = Field(default="router", min_length=1, max_length=64)
    bind_host: str = "0.0.0.0"
    port: int
    served_model_name: str
    # HF checkpoint folder holding the tokenizer and chat template
    tokenizer_dir: Path
    prefill_urls: tuple[str, ...]
    decode_nodes: tuple[DecodeEndpoint, ...]
    native_pool: NativePoolConfig | None = None
    routing: RoutingConfig = RoutingConfig()
    queue_timeout_s: float = Field(default=2.0, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    # the key is never in the config: only where to read it
    api_key_env: str | None = None
    api_key_file: Path | None = None
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # decode-node health checks: a node failing `breaker_failures` in a row leaves rotation
    health_interval_s: float = Field(default=1.0, gt=0)
    # how long one check waits for `/health`; a node busy decoding still answers in milliseconds, a CPU host
    # shared with vLLM can take over a second, and a missed check is not a dead node
    health_timeout_s: float = Field(default=2.0, gt=0)
    breaker_failures: int = Field(default=2, ge=1)
    # the deployment secret (tilepd.auth) the router derives decode-node credentials from
    secret_file: Path | None = None
    log_file: Path | None = None
    # vLLM's --tool-call-parser for this model family (with --enable-auto-tool-choice): tool calls on the low-latency path
    tool_call_parser: str | None = Field(default=None, min_length=1, max_length=64)
    # OpenTelemetry collector (OTLP/HTTP, e.g. http://collector:4318): one trace per request (tilepd/router/tracing.py); off when None
    otlp_endpoint: str | None = Field(default=None, min_length=1, max_length=500)
    prompt_render: PromptRenderConfig = PromptRenderConfig()
    divergence_watch: DivergenceWatchConfig = DivergenceWatchConfig()
