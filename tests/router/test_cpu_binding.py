"""The prefill's vLLM worker computes on the cores it was bound to, although vLLM's NixlConnector (built beside our
connector in MultiConnector) pins the worker's main thread to the last core of the NUMA node on CPU
(tilepd/connector/cpu_binding.py). Read from /proc: the worker process's main thread (its tid is its pid)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilepd.plan.cpu_cores import BIND_ENV, parse_cpu_list

from .conftest import Stack

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:
            continue
        ppid = int(raw[raw.rindex(")") + 2:].split()[1])
        out.setdefault(ppid, []).append(int(stat.parent.name))
    return out


def _workers(root: int) -> list[int]:
    """vLLM's worker processes under a server's process (API server -> EngineCore -> VLLM::Worker)."""
    kids, todo, found = _children(), [root], []
    while todo:
        pid = todo.pop()
        for child in kids.get(pid, []):
            try:
                if Path(f"/proc/{child}/comm").read_text().strip().startswith("VLLM::Worker"):
                    found.append(child)
            except OSError:
                continue
            todo.append(child)
    return found


def _allowed(pid: int) -> set[int] | None:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1].strip())
    return None


def test_the_prefill_worker_computes_on_its_bound_core(router_stack: Stack) -> None:
    assert router_stack.prefill is not None
    bind = Path(f"/proc/{router_stack.prefill.proc.pid}/environ").read_bytes().split(b"\0")
    want = next((parse_cpu_list(e.split(b"=", 1)[1].decode()) for e in bind if e.startswith(BIND_ENV.encode() + b"=")), None)
    if want is None:
        pytest.skip("the stack bound no cores (one core on this machine)")
    workers = _workers(router_stack.prefill.proc.pid)
    assert len(workers) == 1, workers
    assert _allowed(workers[0]) == want, (workers[0], _allowed(workers[0]), want)
    assert "event=cpu_binding_restored" in router_stack.prefill.log_text()
