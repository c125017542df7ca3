"""A wedged decode node comes back by itself (issue 26 part 4): its serving loop tells systemd it is ready and
alive (sd_notify READY=1, WATCHDOG=1 from the loop's tick), and stops telling when the loop is blocked, which is
what makes systemd's `WatchdogSec=` restart it. On real node processes, with the test holding the notify socket
systemd would hold (an AF_UNIX datagram socket named by NOTIFY_SOCKET).

The blocked loop is the documented test-only fault TILEPD_FAULT_WEDGE_LOOP_AFTER_S (tilepd.runtime.liveness):
nothing from outside can block a live node's loop while its other threads run.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.runtime.conftest import start_node, stop_node
from tilepd.runtime.liveness import Liveness, SdNotifier

pytestmark = pytest.mark.slow


def _notify_socket(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(0.5)
    return s


def _datagrams(sock: socket.socket, seconds: float) -> list[tuple[float, str]]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            out.append((time.monotonic(), sock.recv(4096).decode()))
        except TimeoutError:
            pass
    return out


def _datagrams_until_silent(sock: socket.socket, silent_s: float, limit_s: float) -> list[tuple[float, str]]:
    """What the socket receives until `silent_s` passed without a datagram after the first one, or `limit_s` in all."""
    out: list[tuple[float, str]] = []
    end = time.monotonic() + limit_s
    while time.monotonic() < end and not (out and time.monotonic() - out[-1][0] >= silent_s):
        try:
            out.append((time.monotonic(), sock.recv(4096).decode()))
        except TimeoutError:
            pass
    return out


def test_sd_notify_speaks_the_datagram_protocol(tmp_path: Path) -> None:
    sock = _notify_socket(tmp_path / "notify")
    try:
        sent = Liveness("n0", lambda: True, SdNotifier({"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "400000"}))
        for _ in range(3):
            sent.tick()
            time.sleep(0.11)
        got = [m for _, m in _datagrams(sock, 0.6)]
        assert got[0] == "READY=1\nSTATUS=serving" and got[1:] == ["WATCHDOG=1"] * 3, got
        # another process's watchdog (WATCHDOG_PID not ours), or no socket at all: nothing is sent
        assert SdNotifier({"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "1", "WATCHDOG_PID": "1"}).watchdog_s is None
        assert not SdNotifier({}).send("READY=1")
    finally:
        sock.close()


def test_a_wedged_loop_stops_the_watchdog_pings(python_exe: str, tiny_llama: Path, tmp_path: Path) -> None:
    sock = _notify_socket(tmp_path / "notify")
    node = start_node(python_exe, tiny_llama, tmp_path, use_config_file=True,
                      env={"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "2000000",
                           "TILEPD_FAULT_WEDGE_LOOP_AFTER_S": "6"})
    try:
        # the socket queues every datagram from the node's start: about 12 pings before the wedge, then none
        got = _datagrams_until_silent(sock, silent_s=10, limit_s=40)
        assert got and got[0][1].startswith("READY=1"), got[:3]
        pings = [t for t, m in got if m == "WATCHDOG=1"]
        assert len(pings) >= 5, got  # every 0.5 s (a quarter of 2 s) while the loop ticks
        assert "event=fault_injected" in node.log.read_text()
        silent = time.monotonic() - pings[-1]
        assert silent >= 10, f"the wedged node still pinged {silent:.1f} s ago"  # systemd (WatchdogSec) would restart it
        assert node.proc.poll() is None  # alive, yet serving nothing: what only the watchdog catches
        with pytest.raises(httpx.TimeoutException):
            httpx.get(node.http + "/health", timeout=2)
    finally:
        sock.close()
        node.proc.kill()
        node.proc.wait()


def test_stopped_and_continued_node_serves_the_next_request(python_exe: str, tiny_llama: Path, hf_llama, tmp_path: Path) -> None:
    """SIGSTOP then SIGCONT, three times: for 20 s (the stop a node must survive, docs/RELIABILITY.md), then twice for
    6 s (past the stall witness's 5 s dump and the 2 s watchdog, as the first: a stop again after a recovery); each time
    the node pings again and decodes the next request (HF's greedy tokens) within 15 s of the continue."""
    from tests.runtime.hf_engine import hf_greedy
    from tests.runtime.test_decode_server import _body, _handoff, _tokens

    sock = _notify_socket(tmp_path / "notify")
    node = start_node(python_exe, tiny_llama, tmp_path, use_config_file=True,
                      env={"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "2000000"})
    prompt = [5, 17, 42]
    ref = hf_greedy(hf_llama, prompt, 9)
    took: list[float] = []
    try:
        for i, stopped_s in enumerate((20, 6, 6)):
            os.kill(node.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(stopped_s)
                _datagrams(sock, 0.1)  # what was queued before the stop
            finally:
                os.kill(node.proc.pid, signal.SIGCONT)
            t0 = time.monotonic()
            first = _handoff(node, hf_llama, prompt, f"tx-stop-{i}")
            with httpx.Client(base_url=node.http, timeout=15) as c:
                tokens = _tokens(c.post("/v1/decode", json=_body(f"tx-stop-{i}", first, prompt)))
            took.append(time.monotonic() - t0)
            assert [first] + tokens == ref
            assert took[-1] < 15, took
            assert any(m == "WATCHDOG=1" for _, m in _datagrams(sock, 2)), "no watchdog ping after the continue"
        assert node.log.read_text().count("sigcont=1") >= 3
        print(f"decode after continue: {', '.join(f'{t:.1f} s' for t in took)}")
    finally:
        if node.proc.poll() is None:
            os.kill(node.proc.pid, signal.SIGCONT)
        sock.close()
        stop_node(node)
