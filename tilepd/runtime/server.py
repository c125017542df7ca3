"""Start a decode node from a `DecodeServerConfig`: load the engine, then serve control + HTTP."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tilepd.auth import load_secret, transfer_token_ok
from tilepd.otel import require_otel
from tilepd.contracts.fingerprint import FingerprintError
from tilepd.contracts.service_configs import DecodeServerConfig
from tilepd.engine.types import DecodeEngine
from tilepd.runtime.faults import perturb_weights
from tilepd.runtime.geometry import CacheGeometry, geometry_from_spec
from tilepd.weights.manifest import node_fingerprint

log = logging.getLogger("tilepd.runtime")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineLoadError(Exception):
    """The engine could not load the configured weights (message names the folder and the cause)."""


def engine_geometry(engine: DecodeEngine) -> CacheGeometry:
    """The engine's cache geometry, from its ModelSpec (INTERFACES §1)."""
    spec = engine.config
    dtype = getattr(engine, "cache_dtype", None) or getattr(spec, "cache_dtype", None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.removeprefix("torch."), torch.float32)
    return geometry_from_spec(spec, dtype if isinstance(dtype, torch.dtype) else torch.float32)


def start_engine(weights_dir: Path, tp_size: int, **kwargs: Any) -> DecodeEngine:
    """One rank in this process (tp_size 1), or rank 0 here driving tp_size-1 worker processes in lockstep
    (tilepd.engine.tp_engine); both have the engine API of INTERFACES §1."""
    if tp_size == 1:
        from tilepd.engine import load_engine

        return load_engine(weights_dir, **kwargs)
    from tilepd.engine.tp_engine import launch_tp_engine

    return launch_tp_engine(weights_dir, tp_size, **kwargs)


def close_engine(engine: DecodeEngine) -> None:
    """Stop a tensor-parallel engine's worker ranks (a one-rank engine holds nothing to stop)."""
    try:
        engine.close()
    except Exception as exc:  # noqa: BLE001 - shutting down: report, do not mask the original exit
        log.warning("event=engine_close_failed error=%s", exc)


def run_with_node(app: Any, svc: Any, engine: DecodeEngine) -> None:
    """Tie the node's own work to the app's lifespan: a StallWatch on its event loop while it serves (a node that
    stops answering says where it was; its tick pings systemd's watchdog, tilepd.runtime.liveness), and the engine
    closed at shutdown (TP worker ranks stopped): uvicorn re-raises SIGTERM after its graceful shutdown, so code after `uvicorn.run` does not run on a signal."""
    import asyncio

    from tilepd.runtime.liveness import Liveness, wedge_after_s, wedge_forever
    from tilepd.runtime.stall_watch import StallWatch

    inner = app.router.lifespan_context
    wedge = wedge_after_s()

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        if svc.http_listener is not None:  # asyncio reports an accept out of fds to the loop's exception handler
            loop.set_exception_handler(svc.http_listener.on_loop_exception)
        server = svc.http_listener.server if svc.http_listener is not None else None
        liveness = Liveness(svc.config.name, lambda: svc.ready and (server is None or server.started))
        watch = loop.create_task(StallWatch(svc.config.name, observe=svc.metrics.loop_lag.observe, on_tick=liveness.tick).run())
        if wedge is not None:
            loop.call_later(wedge, wedge_forever, svc.config.name)
        try:
            async with inner(a) as state:
                yield state
        finally:
            watch.cancel()
        close_engine(engine)

    app.router.lifespan_context = lifespan


def serve(config: DecodeServerConfig) -> None:
    """Blocking: load the engine, open the control port, serve HTTP until SIGINT/SIGTERM."""
    from tilepd.runtime.fd_limit import raise_nofile_limit
    from tilepd.runtime.http_api import build_app
    from tilepd.runtime.http_server import http_server
    from tilepd.runtime.service import DecodeService

    raise_nofile_limit(config.name)

    # read before the engine loads: a bad secret file fails in a second, not after minutes of loading
    secret = load_secret(config.secret_file) if config.secret_file is not None else None
    require_otel(config.otlp_endpoint, "router.otlp_endpoint (the decode nodes export to the router's collector)")
    if secret is None:
        log.warning("event=unauthenticated node=%s no secret_file configured: anyone who reaches ports %d (HTTP) and %d (control) "
                    "can reserve this node", config.name, config.http_port, config.ctrl_port)
    dtype = None if config.kv_cache_dtype in ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla") else config.kv_cache_dtype
    log.info("event=loading_engine node=%s weights=%s device=%s max_seq_len=%d tp_size=%d", config.name, config.weights_dir,
             config.device, config.max_seq_len, config.tp_size)
    # the engine is built on the thread that will run it (CUDA graphs are captured there)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    t0 = time.perf_counter()
    try:
        engine = worker.submit(
            start_engine, config.weights_dir, config.tp_size, device=config.device, max_seq_len=config.max_seq_len, dtype=dtype,
            use_cuda_graph=config.cuda_graphs if config.device == "cuda" else None,
            num_speculative_tokens=config.num_speculative_tokens,
        ).result()
    except Exception as exc:  # noqa: BLE001 - whatever the loader raises, the node cannot start
        worker.shutdown(wait=False)
        raise EngineLoadError(f"cannot load the {config.family} engine from {config.weights_dir}: {type(exc).__name__}: {exc}") from exc
    log.info("event=engine_loaded node=%s seconds=%.1f", config.name, time.perf_counter() - t0)
    perturb_weights(engine)  # test only: nothing in a deployment sets its variable (tilepd.runtime.faults)
    try:
        fingerprint = node_fingerprint(config.weights_dir, str(getattr(engine, "cache_dtype", "")).removeprefix("torch."))
    except (FingerprintError, OSError) as exc:
        worker.shutdown(wait=False)
        close_engine(engine)
        raise EngineLoadError(f"cannot identify the checkpoint of {config.weights_dir}: {exc}") from exc
    log.info("event=fingerprint node=%s id=%s %s", config.name, fingerprint.id, fingerprint.describe())
    try:
        svc = DecodeService(config, engine, engine_geometry(engine), worker=worker, fingerprint=fingerprint)
        if secret is not None:  # an admit must carry a token minted from the secret too (the connector relays the router's)
            svc.ctrl.token_ok = lambda transfer_id, token: transfer_token_ok(secret, transfer_id, token)
        log.info("event=engine_warm node=%s seconds=%.2f", config.name, svc.warm_up())
        svc.start()
        svc.warm_grammars()  # in the background: the node serves meanwhile
    except OSError as exc:
        worker.shutdown(wait=False)
        close_engine(engine)
        raise OSError(f"cannot open the control or data port ({config.bind_host}:{config.ctrl_port}, transport "
                      f"{config.transport.name}): {exc}") from exc
    app = build_app(svc, secret)
    server, svc.http_listener = http_server(app, config.bind_host, config.http_port)
    run_with_node(app, svc, engine)
    try:
        server.run()
        if not server.started:  # the port could not be bound (uvicorn logged why)
            raise OSError(f"cannot serve HTTP on {config.bind_host}:{config.http_port}")
    finally:
        svc.close()
        close_engine(engine)
        log.info("event=stopped node=%s", config.name)
