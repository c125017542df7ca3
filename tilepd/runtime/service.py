"""The decode node: receive buffer, transport, slot, control server and the engine, wired together.

`DecodeService` holds no HTTP: `http_api` drives it. The engine is used from one
worker thread only (conversion, inject and decode all run there), so the engine
never sees two callers and a CUDA engine keeps one current stream.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tilepd import __version__
from tilepd.contracts.fingerprint import Fingerprint
from tilepd.control.cache_layout import CacheLayout
from tilepd.control.messages import PROTOCOL_VERSION
from tilepd.contracts.decode_http import NODE_API_VERSION
from tilepd.contracts.service_configs import DecodeServerConfig
from tilepd.engine.types import DecodeEngine
from tilepd.runtime.kv_convert import convert, convert_indexer
from tilepd.runtime.ctrl_server import ControlServer
from tilepd.runtime.faults import slow_token_delay, slowed
from tilepd.runtime.geometry import CacheGeometry, check_layout, recv_buffer_bytes
from tilepd.runtime.metrics import DecodeMetrics
from tilepd.runtime.slot import Slot, Transfer
from tilepd.runtime.tracing import make_node_tracing
from tilepd.transport.base import Buffer, TransportReceiver
from tilepd.transport.registry import make_receiver

log = logging.getLogger("tilepd.runtime")


def _engine_types() -> tuple[Any, Any]:
    """KVState and SamplingParams from tilepd.engine (INTERFACES §1)."""
    from tilepd.engine import KVState, SamplingParams

    return KVState, SamplingParams


_REASON = "reason: "  # the drain file's line that keeps a drain's reason across a restart


def _reason_in(drain_file: Any) -> str | None:
    try:
        lines = drain_file.read_text().splitlines()
    except OSError:
        return None
    return next((line[len(_REASON):] for line in lines if line.startswith(_REASON)), None)


@dataclass
class DecodeJob:
    """One decode's parameters as the engine takes them."""

    first_token: int
    max_tokens: int
    sampling: dict[str, Any]
    on_token: Callable[[int], None]
    logprobs: int | None = None  # top-n logprobs per token (engine.decode's logprobs), None: none
    on_logprobs: Callable[[Any], None] | None = None
    grammar: Any = None  # tilepd.engine.grammar.GrammarState, advanced by first_token


@dataclass
class DecodeOutcome:
    tokens: list[int]
    finish_reason: str
    timings: dict[str, float] = field(default_factory=dict)


class DecodeService:
    def __init__(self, config: DecodeServerConfig, engine: DecodeEngine, geometry: CacheGeometry, *,
                 receiver: TransportReceiver | None = None, kv_types: tuple[Any, Any] | None = None,
                 worker: ThreadPoolExecutor | None = None, fingerprint: Fingerprint | None = None):
        self.config = config
        self.fingerprint = fingerprint  # what its weights were converted from (None: not compared, in-process tests)
        self.engine = engine
        self.geometry = geometry
        self.kv_types = kv_types
        self.device = torch.device(config.device)
        buf_device = "cuda" if config.recv_buffer == "vram" else "cpu"
        self.capacity = recv_buffer_bytes(geometry, config.max_seq_len, config.kv_cache_dtype, config.device)
        # zeros, not empty: touching every page now keeps page faults out of the first transfer. A host buffer
        # feeding a GPU engine is pinned: the per-request copy to the GPU then runs at full PCIe/C2C speed
        # (bench/tp_inject.py on 2x H200, 2.68 GB: 65 ms from pinned memory, 359 ms from pageable, scatter included).
        pin = buf_device == "cpu" and self.device.type == "cuda"
        self.recv_buf = torch.zeros(self.capacity, dtype=torch.uint8, device=buf_device, pin_memory=pin)
        self.receiver = receiver or make_receiver(
            config.transport, bind_host=config.bind_host, advertise_host=config.advertise_host,
            allowed_senders=config.allowed_senders, name=f"tilepd-decode-{config.name}",
        )
        self.receiver.register(Buffer.from_array(self.recv_buf))
        self.slot = Slot(on_arm=self.receiver.arm, on_disarm=self.receiver.disarm, orphan_timeout_s=config.kv_timeout_s,
                         on_revoke=lambda conn_id: self.ctrl.revoke(conn_id), lease_s=config.reservation_lease_s)
        self.ctrl = ControlServer(
            slot=self.slot, receiver=self.receiver, max_seq_len=config.max_seq_len, check_layout=self._check_layout,
            node_name=config.name, bind_host=config.bind_host, port=config.ctrl_port, allowed_senders=config.allowed_senders,
            recv_bytes=self.recv_buf, fingerprint=fingerprint,
        )
        self.metrics = DecodeMetrics(self.slot, lambda: self.ctrl.frames_rejected)
        self.worker = worker or ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.last: dict[str, float] = {}
        self.tracing = make_node_tracing(config.otlp_endpoint, config.name)  # None unless a collector is configured
        self._grammars: Any = None  # tilepd.engine.grammar.GrammarCompiler, built on the first constrained request
        self._grammars_lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="slot-reaper", daemon=True)
        self.ready = False
        self.drain_reason: str | None = None  # why it was drained, when the drain said (tilepd.contracts.decode_http.DrainBody)
        self.token_delay_s = slow_token_delay()  # 0.0 outside the tests that inject a slow device
        self.http_listener: Any = None  # tilepd.runtime.http_server.HttpListener, set by the server that serves HTTP

    # -- lifecycle ------------------------------------------------------------------
    def warm_up(self, tokens: int = 4) -> float:
        """Run one tiny decode on the engine thread before serving, so the first request does not pay
        one-time costs (CUDA graph capture, kernel autotuning, lazy allocations). Returns seconds."""
        kv_state_cls, sampling_cls = self.kv_types or _engine_types()
        g = self.geometry

        def run() -> None:
            self.engine.warmup()  # the engine knows what to prepare (CUDA graphs)
            layers = [torch.zeros(1, g.num_heads, g.entry_width, dtype=g.cache_dtype, device=self.device) for _ in range(g.num_layers)]
            indexer = None
            if g.has_indexer:
                indexer = [torch.zeros(1, g.index_head_dim, dtype=g.cache_dtype, device=self.device) if l in g.indexer_layers else None
                           for l in range(g.num_layers)]
            self.engine.inject(kv_state_cls(seq_len=1, layers=layers, indexer=indexer) if indexer is not None
                               else kv_state_cls(seq_len=1, layers=layers))
            self.engine.decode(0, tokens, sampling_cls(ignore_eos=True), lambda t: None, None)
            self.engine.reset()

        t0 = time.perf_counter()
        self.worker.submit(run).result()
        return time.perf_counter() - t0

    def start(self) -> "DecodeService":
        drain_file = self.config.drain_file
        if drain_file is not None and drain_file.exists():  # drained before it stopped: it stays out until undrained
            self.slot.draining = True
            self.drain_reason = _reason_in(drain_file)
            log.warning("event=start_drained node=%s drain_file=%s reason=%r", self.config.name, drain_file, self.drain_reason)
        self.ctrl.start()
        self._reaper.start()
        self.ready = True
        log.info("event=ready node=%s ctrl_port=%d transport=%s recv_buffer_bytes=%d", self.config.name, self.ctrl.port,
                 self.receiver.name, self.capacity)
        return self

    def set_draining(self, draining: bool, reason: str | None = None) -> None:
        """Drain (with why, when given) or undrain, and keep the state in `drain_file` for the next start (a failed
        write is logged: the state in memory still changes)."""
        self.slot.draining = draining
        self.drain_reason = reason if draining else None
        path = self.config.drain_file
        if path is None:
            return
        try:
            if draining:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"drained at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n" + (f"{_REASON}{reason}\n" if reason else ""))
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("event=drain_file_failed node=%s drain_file=%s error=%s", self.config.name, path, exc)

    def close(self) -> None:
        self.ready = False
        self._stop.set()
        self.ctrl.close()
        self.receiver.close()
        self.worker.shutdown(wait=False, cancel_futures=True)
        if self.tracing is not None:
            self.tracing.shutdown()

    def _reap(self) -> None:
        while not self._stop.wait(1.0):
            self.slot.reap_orphans()

    def _check_layout(self, layout: CacheLayout, tp_size: int = 1) -> None:
        check_layout(layout, self.geometry, max_seq_len=self.config.max_seq_len, capacity=self.capacity, tp_size=tp_size)

    # -- views ----------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        return {
            "model": self.config.served_model_name,
            "family": self.geometry.family,
            "max_seq_len": self.config.max_seq_len,
            "sampling": dict(self.engine.capabilities),
            "protocol_version": PROTOCOL_VERSION,
            "node_api": NODE_API_VERSION,
            "reservation_lease_s": self.config.reservation_lease_s,
            "layout": self.geometry.describe(),
            "transport": self.receiver.name,
            "tp_size": self.config.tp_size,
            "tilepd_version": __version__,
            "fingerprint": self.fingerprint.model_dump() if self.fingerprint is not None else None,
        }

    def _grammar_compiler(self) -> Any:
        """The node's GrammarCompiler, built once (transformers' tokenizer and xgrammar's token table: seconds of CPU)."""
        from tilepd.engine.grammar import GrammarCompiler

        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler.from_pretrained(self.config.weights_dir, int(self.engine.config.vocab_size))
            return self._grammars

    def warm_grammars(self) -> threading.Thread | None:
        """Build the grammar compiler on a thread right after start when the engine honours structured output, so
        the first constrained request does not pay for it: built on that request, it once held the node for 25 s
        on a loaded 2-core box (imports under the GIL), long enough for the router to call the node silent."""
        if not self.engine.capabilities.get("structured_output"):
            return None

        def build() -> None:
            t0 = time.perf_counter()
            try:
                self._grammar_compiler()
            except Exception as exc:  # noqa: BLE001 - the first constrained request retries and reports it
                log.warning("event=grammar_warmup_failed node=%s error=%r", self.config.name, exc)
            else:
                log.info("event=grammar_warm node=%s seconds=%.1f", self.config.name, time.perf_counter() - t0)

        th = threading.Thread(target=build, name="grammar-warmup", daemon=True)
        th.start()
        return th

    def grammar_for(self, kind: str, spec: str, stop_token_ids: list[int]) -> Any:
        """A fresh matcher for one request (the compile is cached); its stop tokens are vLLM's all_stop_token_ids."""
        from tilepd.engine.grammar import Constraint

        grammars = self._grammar_compiler()
        compiled = grammars.compile(Constraint(kind, spec))
        stops = set(stop_token_ids) | set(self.engine.config.eos_token_ids)
        return grammars.matcher(compiled, stops)

    def health_problem(self) -> str | None:
        """Why the engine cannot serve (a tensor-parallel worker rank died), or None; /health answers 503 with it."""
        return self.engine.health_problem()

    def listener_problems(self) -> dict[str, str | None]:
        """Each listener's problem (None: accepting): control, data, http. /health fails naming any that has one."""
        http = self.http_listener.problem() if self.http_listener is not None else None
        return {"control": self.ctrl.listener.problem(), "data": self.receiver.listener_problem(), "http": http}

    def status(self) -> dict[str, Any]:
        snap = self.slot.snapshot()
        return {**snap, "last": self.last, "transfers_total": self.slot.transfers_total, "bytes_total": self.slot.bytes_total,
                "fingerprint": self.fingerprint_summary()}

    def fingerprint_summary(self) -> dict[str, Any] | None:
        """The fingerprint as status shows it: its id, the checkpoint's parts and the node's facts."""
        fp = self.fingerprint
        if fp is None:
            return None
        return {"id": fp.id, **({"checkpoint": fp.checkpoint.parts()} if fp.checkpoint is not None else {}), "facts": dict(fp.facts)}

    # -- the decode itself (runs on the engine worker thread) ---------------------------
    def run_decode(self, transfer: Transfer, job: DecodeJob) -> DecodeOutcome:
        kv_state_cls, sampling_cls = self.kv_types or _engine_types()
        t0 = time.perf_counter()
        layers = convert(self.recv_buf, transfer.layout, self.config.max_seq_len, transfer.seq_len,
                         self.geometry.cache_dtype, self.device, tp_size=transfer.tp_size)
        # DSA: the indexer keys, dequantised (only rank 0 sends an MLA/DSA cache, so tp_size is 1 here)
        indexer = convert_indexer(self.recv_buf, transfer.layout, self.config.max_seq_len, transfer.seq_len,
                                  self.geometry.cache_dtype, self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        state = kv_state_cls(seq_len=transfer.seq_len, layers=layers, indexer=indexer) if indexer is not None else \
            kv_state_cls(seq_len=transfer.seq_len, layers=layers)
        self.engine.inject(state)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        extra: dict[str, Any] = {} if job.logprobs is None else {"logprobs": job.logprobs, "on_logprobs": job.on_logprobs}
        if job.grammar is not None:
            extra["grammar"] = job.grammar
        c2 = time.process_time()
        on_token = slowed(job.on_token, self.token_delay_s)
        result = self.engine.decode(job.first_token, job.max_tokens, sampling_cls(**job.sampling), on_token, transfer.cancel, **extra)
        t3 = time.perf_counter()
        n = len(result.tokens)
        # decode_cpu_ms: CPU time of the whole process while the engine decoded (its thread, and the HTTP streaming
        # the tokens cause): the host work per token that serving costs (bench/served_decode.py)
        timings = {"convert_ms": (t1 - t0) * 1e3, "inject_ms": (t2 - t1) * 1e3, "decode_ms": (t3 - t2) * 1e3,
                   "first_step_ms": float(result.timings.get("first_step_ms", 0.0)), "decode_cpu_ms": (time.process_time() - c2) * 1e3,
                   "tokens": n, "tokens_per_s": n / (t3 - t2) if t3 > t2 else 0.0}
        self.metrics.convert.observe(t1 - t0)
        self.metrics.inject.observe(t2 - t1)
        self.metrics.decode.observe(t3 - t2)
        self.metrics.tokens.inc(n)
        self.metrics.tokens_per_s.set(timings["tokens_per_s"])
        return DecodeOutcome(list(result.tokens), str(result.finish_reason), timings)
