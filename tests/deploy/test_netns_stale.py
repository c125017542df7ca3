"""A lab left behind by a killed test run is removed before a new one starts; a live one is not touched."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from tests.deploy.netns import REGISTRY, _claim, _start_time, missing_prerequisites, remove_stale_labs

pytestmark = pytest.mark.skipif(missing_prerequisites() is not None, reason=f"SSH test hosts unavailable: {missing_prerequisites()}")


def _leave_a_lab(tag: str) -> None:
    """What a run killed mid-session leaves: a namespace with an address, and a bridge with the gateway."""
    subprocess.run(["ip", "netns", "add", f"tpd-{tag}-host1"], check=True)
    subprocess.run(["ip", "link", "add", f"tpdbr{tag}", "type", "bridge"], check=True)
    subprocess.run(["ip", "link", "add", f"tpd{tag}v1", "type", "veth", "peer", "name", f"tpd{tag}p1"], check=True)
    subprocess.run(["ip", "link", "set", f"tpd{tag}p1", "netns", f"tpd-{tag}-host1"], check=True)


def _exists(tag: str) -> tuple[bool, bool]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return f"tpd-{tag}-host1" in netns, f"tpdbr{tag}" in links or f"tpd{tag}v1" in links


def _tag() -> str:
    return uuid.uuid4().hex[:5]


def test_a_dead_runs_lab_is_removed() -> None:
    tag = _tag()
    _leave_a_lab(tag)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    REGISTRY.mkdir(parents=True, exist_ok=True)
    (REGISTRY / tag).write_text(f"{dead.pid} 12345")  # its owner has exited
    assert _exists(tag) == (True, True)
    assert tag in remove_stale_labs()
    assert _exists(tag) == (False, False)
    assert not (REGISTRY / tag).exists()


def test_a_live_runs_lab_is_refused_by_name_and_left_alone() -> None:
    tag = _tag()
    _leave_a_lab(tag)
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (REGISTRY / tag).parent.mkdir(parents=True, exist_ok=True)
        (REGISTRY / tag).write_text(f"{owner.pid} {_start_time(owner.pid)}")
        with pytest.raises(RuntimeError, match=rf"another test run \(pid {owner.pid}\) holds the SSH test lab {tag}"):
            remove_stale_labs()
        assert _exists(tag) == (True, True)
    finally:
        owner.kill()
        owner.wait()
    assert tag in remove_stale_labs()  # once its owner is gone it is stale
    assert _exists(tag) == (False, False)


def test_a_reused_pid_does_not_keep_a_dead_runs_lab() -> None:
    """The owner's pid now belongs to another process (this one): its start time tells them apart."""
    import os

    tag = _tag()
    _leave_a_lab(tag)
    REGISTRY.mkdir(parents=True, exist_ok=True)
    (REGISTRY / tag).write_text(f"{os.getppid()} 1")  # a live pid, not the start time it had
    assert tag in remove_stale_labs()
    assert _exists(tag) == (False, False)


def test_this_processes_own_lab_is_kept() -> None:
    tag = _tag()
    _leave_a_lab(tag)
    _claim(tag)
    try:
        assert tag not in remove_stale_labs()
        assert _exists(tag) == (True, True)
    finally:
        (REGISTRY / tag).unlink()
        remove_stale_labs()
    assert _exists(tag) == (False, False)
