"""`tilepd convert-weights TOPOLOGY`: convert the model for every decode node (locally, until deploy routes it).

Nodes sharing one weights_path with the same dtype and tp are converted once. A CPU decode node gets
float32 weights (what its engine computes in), a GPU node bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tilepd.weights.convert import ConvertResult, convert_weights


@dataclass(frozen=True)
class ConvertJob:
    nodes: tuple[str, ...]
    hf_path: Path
    weights_path: Path
    family: str
    dtype: str
    tp: int
    generate_tiny: str | None


def jobs_from_topology(path: Path) -> list[ConvertJob]:
    from tilepd.topology.families import canonical_family
    from tilepd.topology.loader import load_topology

    topo = load_topology(path)
    m = topo.model
    family = canonical_family(m.family) or m.family
    by_key: dict[tuple[str, str, int], list[str]] = {}
    for node in topo.decode:
        dtype = "fp32" if node.gpu.type.lower() == "cpu" else m.weights_dtype
        by_key.setdefault((m.weights_path, dtype, m.tensor_parallel.decode), []).append(node.name)
    return [
        ConvertJob(tuple(nodes), Path(m.hf_path), Path(wp), family, dtype, tp, m.generate_tiny)
        for (wp, dtype, tp), nodes in by_key.items()
    ]


def run_job(job: ConvertJob, *, progress: bool, force: bool) -> ConvertResult:
    if job.generate_tiny and not (job.hf_path / "config.json").is_file():
        from tilepd.dev.tiny_model import make_tiny_model

        make_tiny_model(job.generate_tiny, job.hf_path)
    return convert_weights(job.hf_path, job.weights_path, family=job.family, dtype=job.dtype, tp=job.tp, progress=progress, force=force)
