"""vLLM's CPU core binding (`VLLM_CPU_OMP_THREADS_BIND`): the planner writes it into a CPU vLLM's env
(tilepd.plan.cpu_cores), the connector inside that vLLM's worker reads it back (tilepd.connector.cpu_binding)."""

from __future__ import annotations

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def parse_cpu_list(text: str) -> set[int] | None:
    """The cores of a list like '0-3|5,7' (vLLM's syntax); None for 'auto', 'nobind' or anything unparsable."""
    out: set[int] = set()
    for group in text.split("|"):
        for part in group.split(","):
            part = part.strip()
            lo, sep, hi = part.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                return None
            out.update(range(int(lo), int(hi if sep else lo) + 1))
    return out
