"""Rule `memory-fit`: what each GPU of the deployment must hold, against what it has, before anything launches.

Per decode GPU (the tilepd engine): its shard of the converted weights at `model.weights_dtype` (counted
tensor by tensor from the engine's own weight layout, tilepd/weights/out_tensors.py, so MoE experts, MLA and the
DSA indexer are what the engine loads), the MTP layers, the static caches for one request of `max_seq_len`
(MLA's latent and the indexer keys are replicated on every rank), the KV receive buffer on GPU 0 when it
lives in VRAM, and a workspace allowance. Per vLLM GPU (prefill, native decode): its shard of the weights
vLLM loads (the checkpoint's dtype, or `--quantization fp8`), the KV of one `max_seq_len` request (vLLM
refuses to start without it) and an activation allowance, against `gpu_memory_utilization` of the GPU.

Every figure comes from config.json shapes (tilepd.topology.hf_config); GPU memory from tilepd.topology.gpus
or the topology. Torch-free: `validate` runs on the operator's machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from tilepd.control.cache_layout import FP8_DS_MLA_ENTRY_BYTES
from tilepd.model_format.model_spec import ModelSpec, spec_from_hf_config
from tilepd.topology.gpus import GIB, known_gpu, known_gpu_names
from tilepd.topology.hf_config import ConfigFileError, HfConfig, model_config
from tilepd.topology.schema import DecodeNode, Topology, VllmHostBase
from tilepd.weights.out_tensors import OutTensor, expected_shape, family_layout, source_float_dtype

Loc = tuple[str | int, ...]

FP8_BLOCK = 128  # one fp32 scale per 128x128 block (tilepd/weights/fp8_build.py, DeepSeek's fp8 format)
# CUDA context (~0.5 GiB), cuBLAS/NCCL buffers, CUDA-graph pools and a batch-1 step's activations and logits.
# An allowance, not a measurement: bench/memory_fit.py measures the engine against this module's estimate.
WORKSPACE_BYTES = 2 * GIB
# vLLM's profiled activation peak (max_num_batched_tokens) and CUDA graphs, on top of weights and KV; an allowance.
VLLM_ACTIVATION_BYTES = 2 * GIB
VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default
# vLLM 0.32 DeepseekV32IndexerCache: uint8, 132 bytes per token per indexer layer (128 fp8 e4m3 + one fp32 scale)
VLLM_INDEXER_TOKEN_BYTES = 132
RECV_BLOCK_SLACK = 256  # tilepd/runtime/geometry.py MAX_BLOCK_SLACK: the receive buffer rounds up to a vLLM block
ENGINE_CACHE_BYTES = 2  # the engine's caches are in its compute dtype, bf16 on GPUs, whatever the wire dtype
# (tilepd/runtime/server.py: kv_cache_dtype fp8/fp8_ds_mla/auto -> the engine's default dtype)
MAX_TP_TRIED = 64

PARTS = ("weights", "mtp", "kv_cache", "indexer_cache", "recv_buffer", "workspace")


@dataclass(frozen=True)
class GpuEstimate:
    """Bytes one GPU (or each of a group of identical GPUs) must hold."""

    loc: Loc  # the host entry
    role: str  # decode | prefill | native_decode
    name: str  # the entry's name
    gpus: str  # "GPU 0", "GPUs 1-7", "each of 8 GPUs"
    parts: dict[str, int]
    capacity: int | None  # usable bytes; None: GPU memory unknown
    gpu: str  # e.g. "B200 (nvidia-smi memory.total 183359 MiB)"; "" when unknown
    detail: str  # weights dtype and TP, for people
    gpu_short: str = ""  # e.g. "B200", "B200 x 0.8"

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.total <= self.capacity

    def to_dict(self) -> dict[str, object]:
        return {"path": _loc_str(self.loc), "role": self.role, "name": self.name, "gpus": self.gpus, "gpu": self.gpu, "detail": self.detail,
                "bytes": dict(self.parts), "total_bytes": self.total, "capacity_bytes": self.capacity, "fits": self.fits}


@dataclass
class MemoryReport:
    """Every GPU's estimate, or why there is none; `problems` become findings of rule memory-fit."""

    source: str | None = None  # where the model figures came from
    not_checked: str | None = None  # why no estimate was made
    rows: list[GpuEstimate] = field(default_factory=list)
    problems: list[tuple[Loc, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"model_figures": self.source, "not_checked": self.not_checked, "gpus": [r.to_dict() for r in self.rows]}


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _loc_str(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# --- weights -----------------------------------------------------------------------------------------------

Policy = Callable[[OutTensor, tuple[int, ...]], int]


def _local_shape(t: OutTensor, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Rank-local shape: the sharded dim (per part; experts stacked in front) divided by tp, rounded up."""
    if t.shard_dim is None or tp == 1:
        return shape
    dim = t.shard_dim + (1 if t.stacked else 0)
    out = list(shape)
    out[dim] = -(-out[dim] // tp)
    return tuple(out)


def fp8_bytes(shape: tuple[int, ...]) -> int:
    """One byte per value plus one fp32 scale per 128x128 block (per expert for stacked tensors)."""
    *lead, rows, cols = shape if len(shape) >= 2 else (1, shape[0])
    return math.prod(shape) + 4 * math.prod(lead) * -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)


def decode_policy(weights_dtype: str, source_dtype: str = "bfloat16") -> Policy:
    """What the engine stores (tilepd/weights/fp8_build.py stores_fp8): GEMV weights read through layers.linear
    in fp8 when asked, MLA's W_UK/W_UV and everything else in bf16, the router bias and indexer weights_proj in fp32,
    the router gate in its source's dtype (out_tensors.source_float_dtype; `source_dtype`: the checkpoint's, as
    config.json states it: bf16 for the served models, float32 for the tiny test models)."""
    gate_size = 2 if source_float_dtype(source_dtype, weights_dtype == "fp32") == "bfloat16" else 4

    def size(t: OutTensor, shape: tuple[int, ...]) -> int:
        if t.keep_fp32:
            return 4 * math.prod(shape)
        if t.source_float:
            return gate_size * math.prod(shape)
        if weights_dtype == "fp8" and t.quantizable and not t.mla:
            return fp8_bytes(shape)
        return 2 * math.prod(shape)

    return size


def vllm_policy(fp8_checkpoint: bool, online_fp8: bool) -> Policy:
    """What vLLM holds: an fp8 checkpoint's GEMV weights as they are (with block scales), kv_b_proj in fp8 plus
    the bf16 W_UK/W_UV it dequantises for MLA (mla_attention.py `process_weights_after_loading`), the rest bf16 (the
    router gate too: vLLM 0.32 deepseek_v2.py's GateLinear keeps the model dtype and computes float32 logits from it);
    `--quantization fp8` quantises a bf16 checkpoint's linear layers per tensor."""

    def size(t: OutTensor, shape: tuple[int, ...]) -> int:
        n = math.prod(shape)
        if t.keep_fp32:
            return 4 * n
        if t.mla:
            return fp8_bytes(shape) + 2 * n if fp8_checkpoint else 2 * n
        if t.quantizable and fp8_checkpoint:
            return fp8_bytes(shape)
        if t.quantizable and online_fp8:
            return n
        return 2 * n

    return size


_SHAPES: dict[int, tuple[ModelSpec, list[tuple[OutTensor, tuple[int, ...]]]]] = {}


def layout_shapes(spec: ModelSpec) -> list[tuple[OutTensor, tuple[int, ...]]]:
    """Every runtime tensor of the engine's layout with its unsharded shape (memoised: the fixes re-estimate often)."""
    cached = _SHAPES.get(id(spec))
    if cached is not None and cached[0] is spec:
        return cached[1]
    out = []
    for t in family_layout(spec, set()):
        shape = expected_shape(t.name, spec)
        if shape is None:
            raise ValueError(f"runtime tensor {t.name} has no known shape (tilepd/weights/out_tensors.py expected_shape)")
        out.append((t, shape))
    _SHAPES.clear()
    _SHAPES[id(spec)] = (spec, out)
    return out


def weight_bytes(spec: ModelSpec, tp: int, policy: Policy) -> tuple[int, int]:
    """(main model, MTP layers) bytes on one rank of a TP group, tensor by tensor from the engine's layout."""
    main = mtp = 0
    for t, shape in layout_shapes(spec):
        size = policy(t, _local_shape(t, shape, tp))
        if t.name.startswith("mtp."):
            mtp += size
        else:
            main += size
    return main, mtp


def parameter_count(spec: ModelSpec, *, mtp: bool = False) -> int:
    """Parameters of the runtime layout (MTP layers' own tensors only when `mtp`); kv_b_proj counts once."""
    return sum(math.prod(shape) for t, shape in layout_shapes(spec) if mtp or not t.name.startswith("mtp."))


# --- caches ------------------------------------------------------------------------------------------------


def _indexer_layers(spec: ModelSpec, mtp: bool) -> tuple[int, int]:
    """(main, MTP) layers that keep indexer keys."""
    main = sum(1 for i in range(spec.num_layers) if spec.has_indexer(i))
    extra = sum(1 for k in range(spec.num_mtp_layers) if spec.has_indexer(spec.num_layers + k)) if mtp else 0
    return main, extra


def _engine_kv_token_bytes(spec: ModelSpec, tp: int) -> int:
    """Engine cache bytes per token per layer on one rank: MLA's latent (replicated), or this rank's KV heads."""
    if spec.family == "deepseek_v3":
        return spec.cache_entry_width * ENGINE_CACHE_BYTES
    return 2 * spec.head_dim * -(-spec.num_kv_heads // tp) * ENGINE_CACHE_BYTES


def _wire_token_bytes(spec: ModelSpec, kv_cache_dtype: str) -> int:
    """tilepd/runtime/geometry.py wire_token_bytes for a GPU node: bytes per token per layer a sender may ship."""
    heads = spec.cache_heads
    if kv_cache_dtype == "fp8_ds_mla":
        return heads * max(FP8_DS_MLA_ENTRY_BYTES, spec.cache_entry_width)
    size = 1 if kv_cache_dtype.startswith("fp8") else 2
    return heads * spec.cache_entry_width * size


def _vllm_kv_token_bytes(spec: ModelSpec, kv_cache_dtype: str, tp: int) -> int:
    """vLLM's KV bytes per token per layer on one rank (MLA latent replicated; fp8_ds_mla 656 B per token)."""
    if spec.family == "deepseek_v3":
        if kv_cache_dtype == "fp8_ds_mla":
            return FP8_DS_MLA_ENTRY_BYTES
        return spec.cache_entry_width * (1 if kv_cache_dtype.startswith("fp8") else 2)
    return 2 * spec.head_dim * -(-spec.num_kv_heads // tp) * (1 if kv_cache_dtype.startswith("fp8") else 2)


# --- per role ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Capacity:
    bytes: int | None
    text: str
    short: str = ""


def _capacity(gpu_type: str, memory_gib: float | None, utilization: float = 1.0) -> _Capacity:
    if memory_gib is not None:
        total = int(memory_gib * GIB)
        text = short = f"{gpu_type} ({memory_gib:g} GiB as stated)"
    else:
        known = known_gpu(gpu_type)
        if known is None:
            return _Capacity(None, "")
        total, text, short = known.memory_bytes, f"{known.name} ({known.source})", known.name
    if utilization < 1.0:
        text += f" x gpu_memory_utilization {utilization:g}"
        short += f" x {utilization:g}"
    return _Capacity(int(total * utilization), text, short)


@dataclass(frozen=True)
class DecodeSetting:
    """What a decode estimate depends on; the fixes vary one field."""

    weights_dtype: str
    tp: int
    max_seq_len: int
    recv_vram: bool
    source_dtype: str = "bfloat16"  # the checkpoint's dtype (config.json): the router gate's stored dtype (decode_policy)


def decode_parts(spec: ModelSpec, s: DecodeSetting, kv_cache_dtype: str) -> tuple[dict[str, int], dict[str, int]]:
    """(GPU 0, any other rank) bytes of a tilepd decode engine."""
    main, mtp_w = weight_bytes(spec, s.tp, decode_policy(s.weights_dtype, s.source_dtype))
    kv_token = _engine_kv_token_bytes(spec, s.tp)
    idx_main, idx_mtp = _indexer_layers(spec, mtp=True)
    idx_token = spec.index_head_dim * ENGINE_CACHE_BYTES  # engine keeps dequantised keys [max_seq_len, index_head_dim]
    n = s.max_seq_len
    rope = n * spec.qk_rope_head_dim * 2 * ENGINE_CACHE_BYTES if spec.family == "deepseek_v3" else n * spec.head_dim * 2 * ENGINE_CACHE_BYTES
    other = {
        "weights": main,
        "mtp": mtp_w + spec.num_mtp_layers * n * kv_token + idx_mtp * n * idx_token,
        "kv_cache": spec.num_layers * n * kv_token,
        "indexer_cache": idx_main * n * idx_token,
        "recv_buffer": 0,
        "workspace": WORKSPACE_BYTES + rope,
    }
    first = dict(other)
    if s.recv_vram:  # one buffer for the node, on GPU 0, holding every layer (MTP included) of one request
        wire = (spec.num_layers + spec.num_mtp_layers) * _wire_token_bytes(spec, kv_cache_dtype)
        first["recv_buffer"] = (n + RECV_BLOCK_SLACK) * (wire + (idx_main + idx_mtp) * VLLM_INDEXER_TOKEN_BYTES)
    return first, other


def vllm_parts(spec: ModelSpec, tp: int, max_seq_len: int, kv_cache_dtype: str, fp8_checkpoint: bool, online_fp8: bool,
               speculative: bool) -> dict[str, int]:
    """Bytes on each GPU of a vLLM instance: weights, one max_seq_len request's KV, activations."""
    main, mtp_w = weight_bytes(spec, tp, vllm_policy(fp8_checkpoint, online_fp8))
    kv_token = _vllm_kv_token_bytes(spec, kv_cache_dtype, tp)
    idx_main, idx_mtp = _indexer_layers(spec, mtp=speculative)
    n = max_seq_len
    return {
        "weights": main,
        "mtp": (mtp_w + spec.num_mtp_layers * n * kv_token + idx_mtp * n * VLLM_INDEXER_TOKEN_BYTES) if speculative else 0,
        "kv_cache": spec.num_layers * n * kv_token,
        "indexer_cache": idx_main * n * VLLM_INDEXER_TOKEN_BYTES,
        "recv_buffer": 0,
        "workspace": VLLM_ACTIVATION_BYTES,
    }


def _breakdown(parts: dict[str, int]) -> str:
    names = {"weights": "weights", "mtp": "MTP layers", "kv_cache": "KV cache", "indexer_cache": "indexer cache",
             "recv_buffer": "receive buffer", "workspace": "workspace"}
    return " + ".join(f"{names[k]} {gib(v)}" for k, v in parts.items() if v)


def _max_seq_len_fix(parts_at: Callable[[int], dict[str, int]], capacity: int, current: int) -> int | None:
    """The longest max_seq_len that fits (the estimate is linear in it), or None."""
    base, step = sum(parts_at(1).values()), sum(parts_at(2).values()) - sum(parts_at(1).values())
    if step <= 0 or base > capacity:
        return None
    n = 1 + (capacity - base) // step
    return int(n) if 0 < n < current else None


def _decode_rows(topo: Topology, spec: ModelSpec, source_dtype: str, report: MemoryReport) -> None:
    m = topo.model
    for i, node in enumerate(topo.decode):
        if node.gpu.type.lower() == "cpu" or node.gpu.count == 0:
            continue
        loc: Loc = ("decode", i)
        cap = _capacity(node.gpu.type, node.gpu.memory_gib)
        if cap.bytes is None:
            report.problems.append((loc + ("gpu", "type"), f"GPU type {node.gpu.type!r} is not in tilepd's table ({', '.join(known_gpu_names())}); "
                                    f"state its memory per GPU as decode[{i}].gpu.memory_gib so that the model's fit can be checked"))
        setting = DecodeSetting(m.weights_dtype, m.tensor_parallel.decode, node.max_seq_len or m.max_seq_len,
                                (node.recv_buffer or "vram") == "vram", source_dtype)
        first, other = decode_parts(spec, setting, m.kv_cache_dtype.decode)
        tp = setting.tp
        detail = f"{setting.weights_dtype} weights, TP {tp}, {setting.max_seq_len} tokens"
        if tp == 1:
            groups = [("GPU 0", first)]
        elif first == other:
            groups = [(f"each of {tp} GPUs", first)]
        else:
            groups = [("GPU 0", first), (f"GPUs 1-{tp - 1}" if tp > 2 else "GPU 1", other)]
        rows = [GpuEstimate(loc, "decode", node.name, label, parts, cap.bytes, cap.text, detail, cap.short) for label, parts in groups]
        report.rows += rows
        worst = max(rows, key=lambda r: r.total)
        if worst.fits is False:
            report.problems.append((loc + ("gpu",), _decode_message(topo, spec, node, i, setting, worst)))


def _decode_message(topo: Topology, spec: ModelSpec, node: DecodeNode, i: int, s: DecodeSetting, worst: GpuEstimate) -> str:
    assert worst.capacity is not None
    cap = worst.capacity
    dt = topo.model.kv_cache_dtype.decode

    def total(setting: DecodeSetting) -> int:
        return max(sum(p.values()) for p in decode_parts(spec, setting, dt))

    fixes: list[str] = []
    if s.weights_dtype != "fp8":
        t = total(replace(s, weights_dtype="fp8"))
        fixes.append(f"model.weights_dtype: fp8 ({gib(t)} per GPU{'' if t <= cap else ', still too much alone'})")
    tp = s.tp * 2
    while tp <= MAX_TP_TRIED:
        if total(replace(s, tp=tp)) <= cap:
            fixes.append(f"model.tensor_parallel.decode: {tp} on nodes of {tp} GPUs ({gib(total(replace(s, tp=tp)))} per GPU)")
            break
        tp *= 2
    n = _max_seq_len_fix(lambda k: max(decode_parts(spec, replace(s, max_seq_len=k), dt), key=lambda p: sum(p.values())), cap, s.max_seq_len)
    if n is not None:
        fixes.append(f"model.max_seq_len: {n} or less")
    if s.recv_vram and total(replace(s, recv_vram=False)) <= cap:
        fixes.append(f"decode[{i}].recv_buffer: dram (the receive buffer leaves GPU 0)")
    fix_text = "; ".join(fixes) if fixes else "no single change fits it: use GPUs with more memory"
    return (f"{node.name} needs {gib(worst.total)} on {worst.gpus}, more than the {gib(cap)} of one {worst.gpu}: {_breakdown(worst.parts)} "
            f"({worst.detail}). Fixes: {fix_text}")


def _online_fp8(entry: VllmHostBase) -> bool:
    args = entry.extra_args
    return any(a in ("--quantization=fp8", "-q=fp8") or (a in ("--quantization", "-q") and args[j + 1:j + 2] == ["fp8"]) for j, a in enumerate(args))


def _vllm_rows(topo: Topology, spec: ModelSpec, fp8_checkpoint: bool, report: MemoryReport) -> None:
    m = topo.model
    roles = (("prefill", topo.prefill, m.tensor_parallel.prefill), ("native_decode", topo.native_decode, m.tensor_parallel.native_decode))
    for role, entries, tp in roles:
        for i, e in enumerate(entries):
            if e.gpus == 0 or e.gpu_type is None and e.gpu_memory_gib is None:
                continue  # a CPU host, or a GPU host whose type is not stated: nothing to compare with
            loc: Loc = (role, i)
            util = e.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION
            cap = _capacity(e.gpu_type or "GPU", e.gpu_memory_gib, util)
            if cap.bytes is None:
                report.problems.append((loc + ("gpu_type",), f"GPU type {e.gpu_type!r} is not in tilepd's table ({', '.join(known_gpu_names())}); "
                                        f"state its memory per GPU as {role}[{i}].gpu_memory_gib"))
            online = _online_fp8(e)
            mtp_on = m.speculative.prefill is not None
            kv_dt = m.kv_cache_dtype.prefill

            def parts_at(n: int, tp: int = tp, online: bool = online, mtp_on: bool = mtp_on, kv_dt: str = kv_dt) -> dict[str, int]:
                return vllm_parts(spec, tp, n, kv_dt, fp8_checkpoint, online, mtp_on)

            parts = parts_at(m.max_seq_len)
            dtype = "fp8 checkpoint" if fp8_checkpoint else ("bf16 checkpoint, --quantization fp8" if online else "bf16 checkpoint")
            row = GpuEstimate(loc, role, e.name, f"each of {tp} GPUs" if tp > 1 else "GPU 0", parts, cap.bytes, cap.text,
                              f"{dtype}, TP {tp}, {m.max_seq_len} tokens", cap.short)
            report.rows.append(row)
            if row.fits is False:
                assert cap.bytes is not None
                fixes = []
                if not fp8_checkpoint and not online:
                    fixes.append(f"an fp8 checkpoint at model.hf_path, or `--quantization fp8` in {role}[{i}].extra_args "
                                 f"({gib(sum(vllm_parts(spec, tp, m.max_seq_len, kv_dt, False, True, mtp_on).values()))} per GPU)")
                bigger = tp * 2
                while bigger <= MAX_TP_TRIED and sum(parts_at(m.max_seq_len, tp=bigger).values()) > cap.bytes:
                    bigger *= 2
                if bigger <= MAX_TP_TRIED:
                    fixes.append(f"model.tensor_parallel.{role}: {bigger} on hosts of {bigger} GPUs")
                n = _max_seq_len_fix(parts_at, cap.bytes, m.max_seq_len)
                if n is not None:
                    fixes.append(f"model.max_seq_len: {n} or less")
                if util < 0.95 and row.total <= cap.bytes / util * 0.95:
                    fixes.append(f"a higher {role}[{i}].gpu_memory_utilization")
                where = "gpu_type" if e.gpu_type is not None else "gpu_memory_gib"
                report.problems.append((loc + (where,), f"{e.name}: vLLM needs {gib(row.total)} on {row.gpus}, more than the {gib(cap.bytes)} of one {cap.text}: "
                                        f"{_breakdown(parts)} ({row.detail}). Fixes: {'; '.join(fixes) or 'GPUs with more memory'}"))


def checkpoint_dtype(config: dict) -> str:
    """The checkpoint's float dtype as config.json states it (`dtype`, or the older `torch_dtype`); unstated: float32,
    which never under-counts (the converter stores a non-bf16 router gate in float32)."""
    value = config.get("dtype") or config.get("torch_dtype")
    return value.removeprefix("torch.") if isinstance(value, str) else "float32"


def memory_report(topo: Topology) -> MemoryReport:
    """Every GPU's estimate (rows), or why none was made (not_checked), and what does not fit (problems)."""
    report = MemoryReport()
    if topo.model.generate_tiny:
        report.not_checked = f"model.generate_tiny: the tiny {topo.model.generate_tiny} test model fits any GPU"
        return report
    try:
        found: HfConfig | None = model_config(topo)
    except ConfigFileError:
        report.not_checked = "config.json at model.hf_path is broken (rule model-config)"
        return report
    if found is None:
        report.not_checked = (f"no config.json at {topo.model.hf_path} on this machine and no model.hf_id with bundled figures; "
                              "set model.hf_id or run validate where the checkpoint is")
        if topo.model.hf_id:
            from tilepd.topology.known_models import KNOWN_MODELS

            report.problems.append((("model", "hf_id"), f"{topo.model.hf_id!r} is not among tilepd's bundled model figures ({', '.join(KNOWN_MODELS)}) "
                                    f"and {topo.model.hf_path}/config.json is not readable here; name a known id, or run validate where the checkpoint is"))
        return report
    try:
        spec = spec_from_hf_config(found.config)
    except (ValueError, KeyError, TypeError):
        report.not_checked = "the model's config is refused (rule model-config)"
        return report
    report.source = found.source
    q = found.config.get("quantization_config")
    fp8_checkpoint = isinstance(q, dict) and q.get("quant_method") == "fp8"
    _decode_rows(topo, spec, checkpoint_dtype(found.config), report)
    _vllm_rows(topo, spec, fp8_checkpoint, report)
    return report


def memory_fit(topo: Topology) -> Iterator[tuple[Loc, str]]:
    """(field path, message) for every GPU whose estimate exceeds its memory, or whose memory is unknown."""
    yield from memory_report(topo).problems
