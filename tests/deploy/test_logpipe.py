"""Process-mode logs are bounded and rotated: the rotating file alone, and a real supervised service."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tilepd.deploy import proc
from tilepd.deploy.logpipe import RotatingFile
from tilepd.deploy.proc import ServiceSpec


def _files(log: Path) -> list[Path]:
    return sorted(log.parent.glob(log.name + "*"))


def test_rotating_file_caps_size_and_keeps_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "svc.log"
    out = RotatingFile(log, max_bytes=4096, backups=2)
    lines = [f"line {i:05d} {'x' * (i % 50)}\n".encode() for i in range(3000)]
    for i in range(0, len(lines), 7):  # writes of several lines, as a pipe delivers them
        out.write(b"".join(lines[i : i + 7]))
    out.close()
    files = _files(log)
    assert [p.name for p in files] == ["svc.log", "svc.log.1", "svc.log.2"]  # the oldest were dropped
    assert all(p.stat().st_size <= 4096 for p in files)
    kept = b"".join(p.read_bytes() for p in reversed(files))  # oldest first
    assert kept.endswith(lines[-1]) and kept in b"".join(lines)  # the newest lines, contiguous, no line cut
    assert all(p.read_bytes().endswith(b"\n") for p in files)


def test_rotating_file_refuses_a_tiny_cap(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="4096"):
        RotatingFile(tmp_path / "x.log", max_bytes=100)


_CHATTY = r"""
import signal, sys, time
def bye(*_):
    print("shutting down cleanly", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
for i in range(20000):
    print(f"request {i:06d} " + "y" * 60)
sys.stdout.flush()
print("READY", flush=True)
while True:
    time.sleep(1)
"""


def test_supervised_service_logs_are_rotated_and_the_last_lines_kept(tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(_CHATTY)
    spec = ServiceSpec(name="chatty", role="router", argv=[sys.executable, str(script)], cwd=tmp_path,
                       env={"TILEPD_LOG_MAX_BYTES": "65536", "TILEPD_LOG_BACKUPS": "3"},
                       log_file=tmp_path / "logs" / "chatty.log", pid_file=tmp_path / "run" / "chatty.pid", config_hash="h1")
    try:
        started = proc.start(spec)
        pid = started["pid"]
        assert started["running"] and pid
        deadline = time.monotonic() + 60
        while b"READY" not in spec.log_file.read_bytes():
            assert time.monotonic() < deadline, spec.log_file.read_text()[-500:]
            time.sleep(0.2)
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1] == str(script).encode()  # the recorded pid is the service
        assert proc.status(spec)["running"]  # same pid and kernel start time after the exec
        assert len(proc._group_members(pid)) == 2  # the service and its log pump
    finally:
        stopped = proc.stop(spec)
    assert stopped["signal"] == "SIGTERM" and proc._group_members(pid) == []
    files = _files(spec.log_file)
    assert [p.name for p in files] == ["chatty.log", "chatty.log.1", "chatty.log.2", "chatty.log.3"]  # ~1.5 MB written, 256 KiB kept
    assert all(p.stat().st_size <= 65536 for p in files)
    assert spec.log_file.read_text().rstrip().endswith("shutting down cleanly")  # written after SIGTERM, still kept


def test_systemd_units_log_to_journald_not_an_unbounded_file() -> None:
    from tilepd.plan import build_plan
    from tilepd.plan.systemd import unit_text
    from tilepd.resources import examples_dir
    from tilepd.topology import load_topology

    plan = build_plan(load_topology(examples_dir() / "lab-3host.yaml"))
    for host in plan.hosts:
        for svc in host.services:
            lines = unit_text(plan, svc, f"{host.base_dir}/env/{svc.name}.env").splitlines()
            assert "StandardOutput=journal" in lines and f"SyslogIdentifier=tilepd-{svc.name}" in lines
            assert not any(line.startswith("StandardOutput=append:") for line in lines)
