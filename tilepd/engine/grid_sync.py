"""Device-wide counters a kernel keeps between replays, and the grid barrier a persistent kernel stages its work by.

Why: a persistent kernel (mla_core_triton) runs what used to be three launches as phases of one launch, its programs
meeting at a barrier between phases instead of at a kernel boundary (launch ramp, tail and the gap between). Its
programs must all be resident at once, so its grid is at most one program an SM (`resident_programs`), and the barrier
must survive CUDA-graph replays without a reset launch: the counter only grows, and a program waits for the next
multiple of the grid size (an int64 never wraps in practice: 2^63 / 132 barriers). So a counter serves grids of one
size only: arrivals of another size would leave it off their multiples, and a barrier would release early or never.
A counter first made inside a graph capture would be zeroed only by the graph's own replays, so that is refused by name.

Under TRITON_INTERPRET=1 the programs of a launch run one after another, so a program waiting for a later one would
wait forever: callers run each phase as a launch of its own there (the barrier compiled out), which is how the CPU
tests check the phases' arithmetic; the barrier itself runs only on a GPU (tests/engine/test_mla_core_gpu.py).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton
    triton = None

_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}


def counter(device: torch.device, name: str, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """The device's one-element counter `name`, zeroed when first made (by an uncaptured call: capture_graph warms a
    step up before it captures)."""
    key = (device, name)
    c = _COUNTERS.get(key)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{name}: its counter is made by an uncaptured call; run the step once before capturing it")
        c = _COUNTERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return c


@functools.lru_cache(maxsize=None)
def resident_programs(index: int) -> int:
    """Programs that are surely resident at once on CUDA device `index`: one an SM (a program of at most 8 warps and
    the shared memory of one fits an SM beside nothing else)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


if triton is not None:

    @triton.jit
    def barrier(BAR, n_programs):  # noqa: ANN001, ANN201 - a Triton device function
        """Every program of the grid (n_programs of them, all resident) has reached this point, and the writes each made
        before it are visible to all. A CTA barrier orders the program's own threads' writes before its arrival (one
        gpu-scope acq_rel add); the program then polls (acquire) until the count reaches the next multiple of the grid."""
        tl.debug_barrier()
        arrived = tl.atomic_add(BAR, 1, sem="acq_rel", scope="gpu")
        target = (arrived // n_programs + 1) * n_programs
        seen = arrived + 1
        while seen < target:
            seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
