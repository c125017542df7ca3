"""The prefill's vLLM worker computes on the cores it was bound to, although vLLM's NixlConnector (built beside our
connector in MultiConnector) pins the worker's main thread to the last core of the NUMA node on CPU
(tilepd/connector/cpu_binding.py). The worker is found in the server's process group, as `tilepd down` finds it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tilepd.deploy.proc import _group_members
from tilepd.contracts.cpu_bind import BIND_ENV, parse_cpu_list

from .conftest import Stack

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _workers(pgid: int) -> list[int]:
    """vLLM's worker processes in a server's process group (API server -> EngineCore -> VLLM::Worker)."""
    found = []
    for pid in _group_members(pgid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker"):
                found.append(pid)
        except OSError:
            continue
    return found


def test_the_prefill_worker_computes_on_its_bound_core(router_stack: Stack) -> None:
    assert router_stack.prefill is not None
    bind = Path(f"/proc/{router_stack.prefill.proc.pid}/environ").read_bytes().split(b"\0")
    want = next((parse_cpu_list(e.split(b"=", 1)[1].decode()) for e in bind if e.startswith(BIND_ENV.encode() + b"=")), None)
    if want is None:
        pytest.skip("the stack bound no cores (one core on this machine)")
    workers = _workers(router_stack.prefill.proc.pid)
    assert len(workers) == 1, workers
    # the worker's main thread: its tid is the process's pid
    assert os.sched_getaffinity(workers[0]) == want, (workers[0], os.sched_getaffinity(workers[0]), want)
    assert "event=cpu_binding_restored" in router_stack.prefill.log_text()
