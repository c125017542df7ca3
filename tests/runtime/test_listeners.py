"""The decode node's listeners never die silently (issue 26 part 3), on a real node process.

Fd exhaustion is injected from outside: the test lowers the running node's soft RLIMIT_NOFILE to 1 with prlimit(2)
(the node's stdin holds fd 0, so no new fd can be allocated: every accept() fails with EMFILE) and connects to the
control port; it watches /health over an HTTP connection opened before, which needs no new fd on the node.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import struct
import time
from pathlib import Path

import httpx
from tests.runtime.conftest import start_node, stop_node

_PROBE = {"type": "hello", "protocol": 0}  # another protocol version: a served connection answers a typed error


def _control_answers(port: int, timeout: float = 5.0) -> dict:
    """One frame exchanged on a fresh control connection: the node's error reply to a hello of protocol 0."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        body = json.dumps(_PROBE).encode()
        s.sendall(struct.pack(">I", len(body)) + body)
        (n,) = struct.unpack(">I", _recv(s, 4))
        return json.loads(_recv(s, n))


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def _closed_by_peer(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def test_fd_exhaustion_fails_health_and_the_control_port_accepts_again(python_exe: str, tiny_llama: Path, tmp_path: Path) -> None:
    node = start_node(python_exe, tiny_llama, tmp_path, use_config_file=True)
    pid = node.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    pending: socket.socket | None = None
    try:
        with httpx.Client(base_url=node.http, timeout=5) as health:
            assert health.get("/health").status_code == 200  # this connection stays open for the polls below
            assert _control_answers(node.ctrl_port)["code"] == "version_mismatch"
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (1, hard))
            pending = socket.create_connection(("127.0.0.1", node.ctrl_port), timeout=5)  # in the backlog, unaccepted
            deadline, seen = time.monotonic() + 20, None
            while time.monotonic() < deadline:
                r = health.get("/health")
                if r.status_code != 200:
                    seen = r
                    break
                time.sleep(0.3)
            assert seen is not None, "/health kept answering 200 while the control port could accept nothing"
            assert seen.status_code == 503 and "control listener" in seen.json()["reason"] and "EMFILE" in seen.json()["reason"], seen.text
            assert seen.json()["listeners"]["control"] != "ok" and seen.json()["listeners"]["http"] == "ok"
            time.sleep(2.0)  # several retries fail meanwhile (the backoff reaches 1 s)
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
            assert _control_answers(node.ctrl_port, timeout=10)["code"] == "version_mismatch"
            deadline = time.monotonic() + 10
            while health.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "/health did not recover once fds were free"
                time.sleep(0.3)
        log = node.log.read_text()
        assert "event=accept_failed listener=control" in log and "runbook=RB-accept-failing" in log
        assert "event=accept_recovered listener=control" in log
    finally:
        if pending is not None:
            pending.close()
        if node.proc.poll() is None:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        stop_node(node)


def test_slow_connections_do_not_stop_a_normal_request(python_exe: str, tiny_llama: Path, tmp_path: Path) -> None:
    """200 HTTP connections that send half a request line and 200 control connections that send half a frame
    header, all of them then silent, against a node started with the soft fd limit of 256 a shell may give it:
    a normal request and a control exchange are served meanwhile, and the node drops every slow connection after
    its read timeout (10 s), so they hold neither fds nor threads."""
    from tilepd.runtime.ctrl_server import HELLO_TIMEOUT_S
    from tilepd.runtime.http_server import REQUEST_READ_TIMEOUT_S

    node = start_node(python_exe, tiny_llama, tmp_path, use_config_file=True, nofile_soft=256)
    slow: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        for i in range(200):
            h = socket.create_connection(("127.0.0.1", int(node.http.rsplit(":", 1)[1])), timeout=5)
            h.sendall(b"GET /heal")
            c = socket.create_connection(("127.0.0.1", node.ctrl_port), timeout=5)
            c.sendall(b"\x00\x00")
            slow += [h, c]
        r = httpx.get(node.http + "/health", timeout=10)
        assert r.status_code == 200, r.text
        assert _control_answers(node.ctrl_port, timeout=10)["code"] == "version_mismatch"
        bound = max(REQUEST_READ_TIMEOUT_S, HELLO_TIMEOUT_S)
        deadline = t0 + bound + 20
        open_ = slow
        while open_ and time.monotonic() < deadline:
            open_ = [s for s in open_ if not _closed_by_peer(s)]
            time.sleep(0.5)
        assert not open_, f"{len(open_)} of 400 slow connections still open {time.monotonic() - t0:.0f} s after they began"
        assert httpx.get(node.http + "/health", timeout=10).status_code == 200
        log = node.log.read_text()
        assert "event=http_read_bounded" in log and "why=read_timeout" in log
        assert "event=ctrl_closed" in log and "why=no_hello" in log
        fds = len(os.listdir(f"/proc/{node.proc.pid}/fd"))
        assert fds < 200, f"the node still holds {fds} fds after the slow connections were dropped"
    finally:
        for s in slow:
            s.close()
        stop_node(node)


def test_connections_past_the_cap_are_answered_and_closed_without_a_thread() -> None:
    """In-process, on a real socket: a listener serving its cap of connections hands the next one to `on_full`
    and closes it; once one is released, a new connection is served again."""
    from tilepd.transport.listener import Listener

    held: list[socket.socket] = []
    lst = Listener("control", socket.create_server(("127.0.0.1", 0)), lambda s, a: held.append(s), active=lambda: len(held),
                   max_connections=2, on_full=lambda s, a: s.sendall(b"full")).start()
    try:
        clients = [socket.create_connection(("127.0.0.1", lst.port), timeout=5) for _ in range(2)]
        deadline = time.monotonic() + 5
        while len(held) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        extra = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
        assert _recv(extra, 4) == b"full" and extra.recv(1) == b""
        assert lst.refused_full == 1 and len(held) == 2
        held.pop().close()
        again = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
        deadline = time.monotonic() + 5
        while len(held) < 2:
            assert time.monotonic() < deadline, "the listener took no connection after one was released"
            time.sleep(0.01)
        for c in [*clients, extra, again]:
            c.close()
    finally:
        lst.close()
        for s in held:
            s.close()
