"""A decode node in this process: the real DecodeService and HTTP API behind a real uvicorn server and real sockets,
serving the TEST-ONLY HF engine (tests/runtime/hf_engine.py), for tests that need a node's own answers (its
reservations, its cancel) without a node process's start."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import uvicorn

from tests.runtime.hf_engine import HFEngine, KVState, SamplingParams
from tilepd.connector.launch import free_port
from tilepd.contracts.service_configs import DecodeServerConfig, TransportConfig
from tilepd.runtime.geometry import geometry_from_spec
from tilepd.runtime.http_api import build_app
from tilepd.runtime.service import DecodeService


@contextmanager
def inprocess_node(weights: Path, *, step_delay_s: float = 0.0, kv_timeout_s: float = 5.0, name: str = "n0"
                   ) -> Iterator[tuple[DecodeService, HFEngine, str]]:
    """(the node's service, its engine, its base URL) while the context lasts; tcp transport, ports picked free."""
    eng = HFEngine(weights, step_delay_s=step_delay_s)
    cfg = DecodeServerConfig(name=name, served_model_name="tiny", family="llama", weights_dir=weights, max_seq_len=512,
                             device="cpu", bind_host="127.0.0.1", advertise_host="127.0.0.1", http_port=free_port(), ctrl_port=0,
                             transport=TransportConfig(name="tcp"), kv_timeout_s=kv_timeout_s)
    svc = DecodeService(cfg, eng, geometry_from_spec(eng.config, torch.float32), kv_types=(KVState, SamplingParams)).start()
    server = uvicorn.Server(uvicorn.Config(build_app(svc), host="127.0.0.1", port=cfg.http_port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        while not server.started:
            time.sleep(0.02)
        yield svc, eng, f"http://127.0.0.1:{cfg.http_port}"
    finally:
        server.should_exit = True
        th.join(10)
        svc.close()
