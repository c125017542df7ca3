"""HF safetensors checkpoint -> tilepd runtime weights (per-rank safetensors + manifest.json).

Streaming: one output tensor (one expert, for stacked MoE weights) is in memory at a time, read with
pread and written through a streaming safetensors writer. Outputs are written under *.tmp names and
renamed when complete; the manifest is removed before work starts and written last, atomically, so
an interrupted or failed run never leaves a manifest that describes partial files.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilepd.model_format.model_spec import ModelSpec, spec_from_hf_config
from tilepd.model_format.block_fp8 import DEFAULT_BLOCK, FP8
from tilepd.weights import fp8_build
from tilepd.weights.build import build_chunks, cast_chunk, out_shape, stored_dtype
from tilepd.weights.out_tensors import LAYOUT_VERSION, OutTensor, expected_shape, family_layout
from tilepd.contracts.fingerprint import checkpoint_identity
from tilepd.weights.manifest import CONVERTER_VERSION, FORMAT, MANIFEST, source_entry, source_files, write_manifest_atomically
from tilepd.weights.safetensors_writer import StreamingSafetensorsWriter
from tilepd.weights.skip import resolve_options, try_skip
from tilepd.weights.source import Checkpoint, WeightsError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass
class ConvertResult:
    out_dir: Path
    skipped: bool
    seconds: float
    tensors: int = 0
    bytes_written: int = 0
    files: list[str] = field(default_factory=list)


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


Entry = tuple[str, torch.dtype, tuple[int, ...]]


def _entries(layout: list[OutTensor], ck: Checkpoint, spec: ModelSpec, tp: int, dtype: torch.dtype,
             fp8: bool) -> tuple[list[Entry], dict[str, tuple[int, int]]]:
    """(safetensors entries of one rank, block of each fp8 tensor). An fp8 tensor `x` is stored as `x`
    (float8_e4m3fn) and `x.scale` (float32 block scales, fp8_build.block_and_scale_shape)."""
    entries: list[Entry] = []
    blocks: dict[str, tuple[int, int]] = {}
    source_block = ck.fp8_block()
    for t in layout:
        full = out_shape(t, ck.shape, spec, 1)
        want = expected_shape(t.name, spec)
        if want is not None and tuple(full) != tuple(want):
            raise WeightsError(
                f"{ck.dir}: {t.name} built from {t.sources[:3]}{'...' if len(t.sources) > 3 else ''} has shape {list(full)}, "
                f"config.json implies {list(want)}"
            )
        shape = out_shape(t, ck.shape, spec, tp)
        if fp8_build.stores_fp8(t, ck.is_fp8, fp8, source_block is not None):
            block, scale_shape = fp8_build.block_and_scale_shape(t, ck.shape, tp, source_block or DEFAULT_BLOCK)
            blocks[t.name] = block
            entries += [(t.name, FP8, shape), (t.name + ".scale", torch.float32, scale_shape)]
        else:
            entries.append((t.name, stored_dtype(t, ck.dtype(t.sources[0]), dtype), shape))
    return entries, blocks


def convert_weights(
    model_dir: Path, out_dir: Path, *, family: str | None = None, dtype: str = "bf16", tp: int = 1,
    progress: bool = True, force: bool = False,
) -> ConvertResult:
    """Convert (or skip when the manifest says the same inputs were already converted)."""
    t0 = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    options = resolve_options(model_dir, family, dtype, tp)
    if not force and try_skip(model_dir, out_dir, options):
        return ConvertResult(out_dir, True, time.perf_counter() - t0)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    with Checkpoint(model_dir) as ck:
        spec = spec_from_hf_config(ck.config(), ck.generation_config())
        layout = family_layout(spec, ck.names())
        missing = sorted({s for t in layout for s in t.sources} - ck.names())
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise WeightsError(f"{model_dir}: checkpoint lacks tensor(s) {', '.join(missing[:5])}{more}")
        fp8 = dtype == "fp8"
        entries, blocks = _entries(layout, ck, spec, tp, DTYPES[dtype], fp8)
        sources = [source_entry(p, model_dir) for p in source_files(model_dir)]
        identity = checkpoint_identity(model_dir)  # what a prefill serving this checkpoint computes (contracts.fingerprint)
        written = _write_ranks(layout, ck, spec, tp, DTYPES[dtype], blocks, entries, out_dir, progress)
    for name in COPIED_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)
    files = [{"file": rank_file(r), "rank": r, "size": (out_dir / rank_file(r)).stat().st_size} for r in range(tp)]
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "converter_version": CONVERTER_VERSION,
        "layout_version": LAYOUT_VERSION,
        "options": options,
        "family": spec.family,
        "dtype": dtype,
        "weight_format": "fp8-block" if blocks else dtype,
        "tp": tp,
        "model_config": ck.config(),
        "generation_config": ck.generation_config(),
        "spec": spec.to_dict(),
        "layout": {
            "fused": {"llama": ["wqkv = [q; k; v]", "w13 = [gate; up]"], "deepseek_v3": ["w13 = [gate; up]", "w_uk/w_uv = kv_b_proj per head"]}[spec.family],
            "tied_embeddings": spec.tie_word_embeddings,
            "fp8_scales": ("block-scaled e4m3: weight[r, c] = fp8[r, c] * scale[r // block[0], c // block[1]] "
                           "(per expert when stacked)") if blocks else None,
            "tensors": {name: {"dtype": str(dt).removeprefix("torch."), "shape": list(shape),
                               **({"block": list(blocks[name])} if name in blocks else {})} for name, dt, shape in entries},
        },
        "sources": sources,
        "source_identity": identity.model_dump(),
        "files": files,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_manifest_atomically(out_dir, manifest)
    return ConvertResult(out_dir, False, time.perf_counter() - t0, len(entries), written, [f["file"] for f in files])


def _write_ranks(layout, ck, spec, tp, dtype, blocks, entries, out_dir: Path, progress: bool) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    get_fp8 = fp8_build.source_reader(ck.get_raw, ck.fp8_block() or DEFAULT_BLOCK) if blocks else None
    planned = {name: dt for name, dt, _ in entries}
    written = 0
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress, transient=False) as bar:
        task = bar.add_task("converting", total=len(layout) * tp)
        for rank in range(tp):
            tmp = out_dir / (rank_file(rank) + ".tmp")
            writer = StreamingSafetensorsWriter(tmp, entries, metadata={"format": "pt", "tilepd": FORMAT, "rank": str(rank), "tp": str(tp)})
            try:
                for t in layout:
                    bar.update(task, description=f"rank {rank}: {t.name}")
                    if t.name in blocks:
                        scales = []
                        for q in fp8_build.build(t, get_fp8, blocks[t.name], rank, tp):
                            writer.write(t.name, q.weight)
                            written += q.weight.numel()
                            scales.append(q.scale)
                        scale = torch.stack(scales) if t.stacked else scales[0]
                        writer.write(t.name + ".scale", scale)
                        written += scale.numel() * 4
                    else:
                        for chunk in build_chunks(t, ck.get, spec, rank, tp):
                            data, _ = cast_chunk(t, chunk, dtype)
                            if data.dtype != planned[t.name]:  # the header is written: a dtype it does not name would be misread
                                raise WeightsError(f"{t.name}: built as {data.dtype}, the file's header (from {t.sources[0]}'s "
                                                   f"header dtype) says {planned[t.name]}")
                            writer.write(t.name, data)
                            written += data.numel() * data.element_size()
                    bar.advance(task)
                writer.close()
            except BaseException:
                writer.abort()
                raise
            os.replace(tmp, out_dir / rank_file(rank))
        bar.update(task, description=f"converted ({tp} rank{'s' if tp > 1 else ''})")
    return written
