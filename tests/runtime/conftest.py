"""Decode-server fixtures: a real `python -m tilepd.runtime` process on free ports, and KV payloads from HF."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from tilepd.connector.launch import free_port  # noqa: F401  (re-exported for the runtime tests)


@dataclass
class DecodeNode:
    proc: subprocess.Popen
    http: str
    ctrl_port: int
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.http, timeout=60)


def start_node(python: str, weights: Path, tmp: Path, transport: str = "tcp", family: str = "llama",
               kv_timeout_s: float = 15.0, max_seq_len: int = 512, use_config_file: bool = False,
               secret_file: Path | None = None, drain_file: Path | None = None, nofile_soft: int | None = None,
               env: dict[str, str] | None = None) -> DecodeNode:
    """Start `python -m tilepd.runtime` from flags, or from a DecodeServerConfig file as the plan renders it
    (always so with a deployment `secret_file` or a `drain_file`, which have no flag); `nofile_soft` starts it
    under that soft fd limit (prlimit; the hard one unchanged). Returns once /health answers (200, or 503 draining:
    a node that starts drained); `env` is added to the node's environment."""
    http_port, ctrl_port = free_port(), free_port()
    log = tmp / f"decode-{transport}.log"
    if use_config_file or secret_file is not None or drain_file is not None:
        from tilepd.contracts.service_configs import DecodeServerConfig, TransportConfig

        cfg = DecodeServerConfig(name=f"test-{transport}", served_model_name="tiny", family=family, weights_dir=weights,
                                 max_seq_len=max_seq_len, device="cpu", bind_host="127.0.0.1", advertise_host="127.0.0.1",
                                 http_port=http_port, ctrl_port=ctrl_port, transport=TransportConfig(name=transport),
                                 kv_timeout_s=kv_timeout_s, log_file=tmp / f"decode-{transport}.file.log", secret_file=secret_file,
                                 drain_file=drain_file)
        cfg_file = tmp / "decode.json"
        cfg_file.write_text(cfg.model_dump_json(indent=2))
        argv = [python, "-m", "tilepd.runtime", "--config", str(cfg_file)]
    else:
        argv = [python, "-m", "tilepd.runtime", "--weights", str(weights), "--family", family, "--max-seq-len", str(max_seq_len),
                "--host", "127.0.0.1", "--http-port", str(http_port), "--ctrl-port", str(ctrl_port), "--transport", transport,
                "--kv-timeout-s", str(kv_timeout_s), "--name", f"test-{transport}"]
    if nofile_soft is not None:
        import resource

        argv = ["prlimit", f"--nofile={nofile_soft}:{resource.getrlimit(resource.RLIMIT_NOFILE)[1]}", "--", *argv]
    import os

    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    node = DecodeNode(proc, f"http://127.0.0.1:{http_port}", ctrl_port, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"decode server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            health = httpx.get(node.http + "/health", timeout=1)
            if health.status_code == 200 or (health.status_code == 503 and health.json().get("status") == "draining"):
                return node
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_node(node)
    raise RuntimeError(f"decode server not healthy in 120 s:\n{log.read_text()[-3000:]}")


def stop_node(node: DecodeNode) -> None:
    if node.proc.poll() is None:
        node.proc.terminate()
        try:
            node.proc.wait(15)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()


@pytest.fixture(scope="session")
def hf_llama(tiny_llama: Path):
    from transformers import AutoModelForCausalLM
    import torch

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama_node(python_exe: str, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    node = start_node(python_exe, tiny_llama, tmp_path_factory.mktemp("node"), use_config_file=True)
    yield node
    stop_node(node)


def wire_payload(layers, layout) -> np.ndarray:
    from tilepd.runtime.kv_convert import to_wire

    return np.frombuffer(to_wire(layers, layout), np.uint8).copy()
