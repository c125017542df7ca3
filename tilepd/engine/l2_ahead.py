"""L2 look-ahead: the decode step's latency-bound kernels pull a later kernel's weights into L2 while HBM idles.

Why: at batch 1 a DeepSeek-family layer alternates bandwidth-bound GEMVs with four latency-bound kernels (prepare, the
split MLA kernel, merge + W_UV, the MoE gate), each 8-10 us on an H100 for 0.4-5 us of bytes, and the attention's norm
GEMVs (G1, G2) spend half their time ramping up (docs/PERFORMANCE.md).
While those run, HBM is mostly idle. Here each of them issues sm_90's bulk prefetch (`cp.async.bulk.prefetch.L2.global`:
one instruction a byte range, no register written, nothing waits on it) over the first bytes of a weight that a kernel
after it reads, so that kernel's first loads hit L2 instead of HBM. Weights only: no kernel of the step writes them,
so the prefetch needs no ordering and may run before pdl.py's wait, like any weight read.

Hosts and what each pulls (`TARGETS`), chosen so that little is streamed through L2 between the prefetch and its use:

  g1      -> G2's weight rows, their first bytes (G1: the fp8 GEMV over [wq_a | idx_wk | wkv_a], at ~55% of the
             bandwidth at batch 1: a ramp, not a stream; fp8 weights only);
  g2      -> W_UK (prepare's weight; G2 is the fp8 GEMV over [wq_b | idx_wq_b]);
  prepare -> W_UV (merge_uv's weight; the split kernel in between reads a few MB of latent rows);
  split   -> wo's rows, their first bytes;
  merge   -> wo's rows, the bytes after split's window (or the first bytes when split is not a host);
  gate    -> the shared expert's [gate; up] rows, their first bytes (known before the routing; the routed ones are not);
  attn, attn_merge -> Llama's split-KV attention kernel and its merge (attention.py): wo's rows, as split and merge.

A region is bytes [skip, skip + n) of each of R rows at a byte stride (n capped so that a host pulls at most
TILEPD_L2_AHEAD_MB); a contiguous weight that fits is one range. It is cut into CHUNK-byte prefetches spread over the
host's programs, at most one a thread. The bandwidth-bound GEMVs (wo, gate-up, down) host nothing: there HBM is busy
and a prefetch only competes (the fp8 GEMV's own L2 prefetch-ahead measured up to 56% slower on an H100, 2026-12-05).

Switches (env, read at import; tests and benches may set SWITCH's entries):
  TILEPD_L2_AHEAD             host kinds separated by "," or "+" (depth_step.sh's settings split on commas), or "all";
                              default none: off until measured faster on the device;
  TILEPD_L2_AHEAD_MB          MiB a host pulls at most (default 12);
  TILEPD_L2_AHEAD_CHUNK       bytes a prefetch (default 16384, a multiple of 16);
  TILEPD_L2_AHEAD_EVICT_LAST  1: the lines are marked evict_last, so streaming reads of other weights evict them last.
Off under TRITON_INTERPRET=1, on CPU tensors and below sm_90 (as pdl.py), and for a weight whose base or row stride is
not 16-byte aligned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tilepd.engine import pdl
from tilepd.engine.tuning import env_int
from tilepd.model_format.block_fp8 import BlockFp8

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton
    triton = None

HOSTS = ("g1", "g2", "prepare", "split", "merge", "gate", "attn", "attn_merge")
TARGETS = {"g1": "G2's weight", "g2": "W_UK", "prepare": "W_UV", "split": "wo (first bytes)", "merge": "wo (after split's)",
           "gate": "shared expert [gate; up]", "attn": "Llama's wo (first bytes)", "attn_merge": "Llama's wo (after attn's)"}


def _hosts(raw: str) -> frozenset[str]:
    kinds = frozenset(HOSTS) if raw.strip() == "all" else frozenset(k.strip() for k in raw.replace("+", ",").split(",") if k.strip())
    if not kinds <= set(HOSTS):
        raise ValueError(f"TILEPD_L2_AHEAD={raw!r}: host kinds are {', '.join(HOSTS)} (or all)")
    return kinds


SWITCH: dict = {"hosts": _hosts(os.environ.get("TILEPD_L2_AHEAD", "")), "mb": env_int("TILEPD_L2_AHEAD_MB", 12),
                "chunk": env_int("TILEPD_L2_AHEAD_CHUNK", 16384), "evict_last": env_int("TILEPD_L2_AHEAD_EVICT_LAST", 0)}
if SWITCH["chunk"] < 16 or SWITCH["chunk"] % 16:
    raise ValueError(f"TILEPD_L2_AHEAD_CHUNK={SWITCH['chunk']}: a positive multiple of 16 bytes")
if not 1 <= SWITCH["mb"] <= 1024:  # the kernels' byte arithmetic is 32-bit within a row
    raise ValueError(f"TILEPD_L2_AHEAD_MB={SWITCH['mb']}: 1 to 1024 (MiB a host pulls at most)")


@dataclass(frozen=True)
class Region:
    """Bytes [skip, skip + row_bytes) of `rows` rows of `base` (a uint8 view of the weight), `stride` bytes apart."""

    base: torch.Tensor
    rows: int
    row_bytes: int
    stride: int
    skip: int = 0


def _rows_view(w: torch.Tensor | BlockFp8) -> torch.Tensor | None:
    """The weight's values as [rows, row bytes] uint8 (a view), or None where its rows are not evenly strided."""
    t = w.weight if isinstance(w, BlockFp8) else w
    if t.dim() < 2 or t.stride(-1) != 1 or t.numel() == 0:
        return None
    flat = t.reshape(-1, t.shape[-1]) if t.is_contiguous() else (t if t.dim() == 2 else None)
    if flat is None:
        return None
    return flat.view(torch.uint8)


def regions(w: torch.Tensor | BlockFp8, kinds: tuple[str, ...], budget: int | None = None) -> dict[str, Region]:
    """Consecutive per-row byte windows of `w` for the hosts among `kinds` that are switched on, in that order (the
    first host gets each row's first bytes), each of at most `budget` bytes in all (default SWITCH["mb"] MiB); a
    contiguous weight that fits the budget whole goes to the first host as one range."""
    on = [k for k in kinds if k in SWITCH["hosts"]]
    view = _rows_view(w) if on else None
    if view is None:
        return {}
    budget = SWITCH["mb"] << 20 if budget is None else budget
    rows, row_total = view.shape
    stride = view.stride(0)
    if view.data_ptr() % 16 or stride % 16:
        return {}
    if stride == row_total and rows * row_total <= budget:
        return {on[0]: Region(view, 1, rows * row_total, rows * row_total)}
    out, skip = {}, 0
    for kind in on:
        per_row = min(row_total - skip, budget // rows) // 16 * 16
        if per_row < 128:  # less than a cache line a row (or nothing left): not worth a prefetch
            break
        out[kind] = Region(view, rows, per_row, stride, skip)
        skip += per_row
    return out


def _enabled(t: torch.Tensor) -> bool:
    """Where the host kernel runs: a CUDA tensor of an sm_90+ device, not the interpreter (pdl.py's rule)."""
    if triton is None or not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return pdl._device_supports(t.device.index if t.device.index is not None else torch.cuda.current_device())


def plan(region: Region, programs: int, num_warps: int) -> tuple[int, int]:
    """(rows, chunk bytes) of a region spread over `programs` programs of 32 * num_warps threads, one prefetch a thread
    at most: a long row takes bigger chunks, rows beyond one a thread are left out."""
    capacity = programs * 32 * num_warps
    rows = min(region.rows, capacity)
    chunk = SWITCH["chunk"]
    while rows * -(-region.row_bytes // chunk) > capacity:
        chunk *= 2
    return rows, chunk


def launch_args(kind: str, region: Region | None, host: torch.Tensor, programs: int, num_warps: int) -> dict:
    """The host kernel's look-ahead arguments (AH 0: off; the host's tensor `host` decides where it runs and stands in
    for the pointer when off)."""
    if region is None or kind not in SWITCH["hosts"] or not _enabled(host):
        return {"AH_PTR": host, "ah_rows": 0, "ah_row_bytes": 0, "ah_stride": 0, "AH": 0, "AH_CHUNK": 16, "AH_NT": 32, "AH_EVICT": 0}
    rows, chunk = plan(region, programs, num_warps)
    base = region.base[:, region.skip:] if region.skip else region.base  # the kernel reads only its data pointer
    return {"AH_PTR": base, "ah_rows": rows, "ah_row_bytes": region.row_bytes, "ah_stride": region.stride, "AH": 1, "AH_CHUNK": chunk,
            "AH_NT": 32 * num_warps, "AH_EVICT": int(bool(SWITCH["evict_last"]))}


if triton is not None:

    @triton.jit
    def items(rows, row_bytes, stride, lin, nprog, CHUNK: tl.constexpr, NT: tl.constexpr):  # noqa: ANN001, ANN201
        """Program `lin` of `nprog`'s share of the region's CHUNK-byte pieces: (byte offsets, sizes, valid), NT wide."""
        per_row = (row_bytes + CHUNK - 1) // CHUNK
        total = rows * per_row
        share = (total + nprog - 1) // nprog
        e = tl.arange(0, NT)
        i = lin * share + e
        ok = (e < share) & (i < total)
        row = i // per_row
        c = i - row * per_row
        size = tl.minimum(row_bytes - c * CHUNK, CHUNK)
        return row.to(tl.int64) * stride + c.to(tl.int64) * CHUNK, size, ok

    @triton.jit
    def issue(PTR, rows, row_bytes, stride, CHUNK: tl.constexpr, NT: tl.constexpr, EVICT: tl.constexpr):  # noqa: ANN001, ANN201
        """This program's bulk prefetches of the region (every program of a 1-D or 2-D grid takes a share)."""
        lin = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        offs, size, ok = items(rows, row_bytes, stride, lin, tl.num_programs(0) * tl.num_programs(1), CHUNK, NT)
        if EVICT:
            tl.inline_asm_elementwise(
                asm="{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $3, 0; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                    "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
                constraints="=r,l,r,r", args=[PTR + offs, size.to(tl.int32), ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                asm="{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                constraints="=r,l,r,r", args=[PTR + offs, size.to(tl.int32), ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
