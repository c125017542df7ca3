"""The connector puts a CPU worker's thread back on its rank's bound cores (tilepd/connector/cpu_binding.py): a real
thread moved off its cores, as vLLM's NixlConnector moves the worker's main thread, is moved back."""

from __future__ import annotations

import os
import threading

import pytest

from tilepd.connector.cpu_binding import bound_cores, restore_bound_cores
from tilepd.contracts.cpu_bind import BIND_ENV


def test_bound_cores_per_rank() -> None:
    assert bound_cores("0-1|2-3", 1, 2) == {2, 3} and bound_cores("5", 0, 1) == {5}
    assert bound_cores("auto", 0, 1) is None and bound_cores("nobind", 0, 1) is None and bound_cores(None, 0, 1) is None
    assert bound_cores("0|1", 0, 1) is None  # two lists for one rank: not ours to guess


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move a thread between")
def test_a_moved_thread_is_put_back_on_its_bound_core(monkeypatch: pytest.MonkeyPatch) -> None:
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    monkeypatch.setenv(BIND_ENV, str(first))
    seen: dict[str, object] = {}

    def worker_thread() -> None:  # a thread of its own: the test process's main thread keeps its cores
        os.sched_setaffinity(0, {last})  # what NixlConnector does to the worker's main thread
        seen["moved"] = restore_bound_cores(0, 1)
        seen["now"] = os.sched_getaffinity(0)
        seen["again"] = restore_bound_cores(0, 1)  # already there: nothing to do

    th = threading.Thread(target=worker_thread)
    th.start()
    th.join(30)
    assert seen["moved"] == ({last}, {first}) and seen["now"] == {first} and seen["again"] is None, seen
    monkeypatch.setenv(BIND_ENV, "auto")
    assert restore_bound_cores(0, 1) is None  # vLLM's own choice is left alone
