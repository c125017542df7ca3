"""Drive N tensor-parallel ranks as one engine: rank 0 is the caller's process, ranks 1..N-1 are workers.

`launch_tp_engine` starts the workers (`python -m tilepd.engine.tp_worker`, one process per rank/GPU),
joins them in a process group (NCCL on CUDA, gloo on CPU; a gloo group carries the control messages)
and returns a `TPEngine` with the engine API of INTERFACES §1, so the decode server uses it unchanged.

Lockstep: every call on rank 0 first broadcasts a command, then every rank runs the same engine method
with the same arguments, so the collectives inside the forward pass line up. Decode stays in lockstep
because every rank sees the same logits (all-gathered) and the same sampling seed (rank 0 draws one when
the request has none), so every rank picks the same token and the same stop; the cancel flag is the one
per-step input only rank 0 knows, and `SyncedCancel` broadcasts it at the point where the decode loop
checks it. `inject` scatters the full received state: each rank gets its KV heads (standard attention)
or the whole latent (MLA, replicated).
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tilepd.engine.tp import TPGroup, local_spec
from tilepd.engine.types import DecodeResult, KVState, SamplingParams

log = logging.getLogger("tilepd.engine.tp")

STORE_HOST = "127.0.0.1"
TIMEOUT = timedelta(minutes=10)


class SyncedCancel:
    """A cancel event every rank agrees on: rank 0 reads the real event and broadcasts it on every check."""

    def __init__(self, tp: TPGroup, event: Any) -> None:
        self.tp = tp
        self.event = event
        self.flag = torch.zeros(1, dtype=torch.int32)

    def is_set(self) -> bool:
        if self.tp.rank == 0:
            self.flag.fill_(int(self.event is not None and self.event.is_set()))
        dist.broadcast(self.flag, 0, group=self.tp.ctrl)
        return bool(self.flag.item())


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r uses GPU r of the host (cuda) or the CPU."""
    return torch.device(f"cuda:{rank}") if torch.device(device).type == "cuda" else torch.device("cpu")


def init_group(rank: int, size: int, store: dist.Store, device: str) -> TPGroup:
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    ctrl = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return TPGroup(rank, size, dist.group.WORLD, ctrl)


def load_rank_engine(weights_dir: Path, tp: TPGroup, device: str = "cpu", max_seq_len: int = 4096, dtype: str | None = None, *,
                     use_cuda_graph: bool | None = None, num_speculative_tokens: int | None = None, cpu_threads: int = 1,
                     speed_path: bool = True):
    """This rank's `Engine`: its weight shard, its share of the heads; `config` is the whole model's spec.

    On CUDA each rank captures its own decode graphs with the NCCL all-reduces inside (the communicator is
    brought up eagerly first, as capture requires) and takes load_engine's speed path (compiled.accelerate)."""
    from tilepd.engine.engine import _DTYPES, engine_for
    from tilepd.engine.tp import build_tp_model
    from tilepd.engine.weights_loader import load_weights

    dev = rank_device(device, tp.rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif cpu_threads > 0:
        torch.set_num_threads(cpu_threads)
    name = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    torch_dtype = _DTYPES[name]
    spec, weights = load_weights(weights_dir, dev, torch_dtype, rank=tp.rank, tp=tp.size)
    spec = spec.with_cache_dtype(str(torch_dtype).removeprefix("torch."))
    model = build_tp_model(spec, weights, max_seq_len, dev, torch_dtype, tp)
    if num_speculative_tokens is None:
        num_speculative_tokens = 1 if getattr(model, "has_mtp", False) else 0
    if dev.type == "cuda":
        tp.all_reduce(torch.zeros(1, device=dev))  # NCCL communicator up before any graph capture
    engine = engine_for(model, spec, dev, max_seq_len, use_cuda_graph=use_cuda_graph,
                        num_speculative_tokens=num_speculative_tokens, speed_path=speed_path)
    from tilepd.engine.memory import log_memory

    engine.memory = log_memory(weights, dev)  # this rank's GPU memory at start
    return engine


def _bcast_cmd(tp: TPGroup, cmd: list[Any] | None) -> list[Any]:
    box = [cmd]
    dist.broadcast_object_list(box, 0, group=tp.ctrl)
    return box[0]


def _recv_state(engine: Any, tp: TPGroup, seq_len: int, num_layers: int, indexed: list[bool] | None = None) -> KVState:
    """Worker side of inject: this rank's part of each layer (its heads, or the replicated latent), then the
    DSA indexer keys (replicated) of the layers flagged in `indexed`."""
    caches = list(engine.model.caches) + list(getattr(engine.model, "mtp_caches", []))
    layers = []
    for l in range(num_layers):
        t = torch.empty(seq_len, *caches[l].shape[1:], dtype=caches[l].dtype, device=engine.device)
        if engine.config.family == "deepseek_v3":
            dist.broadcast(t, 0, group=tp.group)
        else:
            dist.scatter(t, None, src=0, group=tp.group)
        layers.append(t)
    if indexed is None:
        return KVState(seq_len, layers)
    keys = engine.model.index_cache_list()
    indexer: list[torch.Tensor | None] = []
    for l, present in enumerate(indexed):
        t = torch.empty(seq_len, keys[l].shape[1], dtype=keys[l].dtype, device=engine.device) if present else None
        if t is not None:
            dist.broadcast(t, 0, group=tp.group)
        indexer.append(t)
    return KVState(seq_len, layers, indexer)


def tokens_agree(tp: TPGroup, tokens: list[int]) -> bool:
    """Every rank reports (count, checksum) of the tokens it decoded; True when all ranks match rank 0.

    One small gloo collective per request: a divergence (a nondeterministic kernel, a seed mix-up) would
    otherwise only show as a later hang or garbage, so rank 0 checks it and fails the request."""
    mine = torch.tensor([len(tokens), sum((i + 1) * t for i, t in enumerate(tokens)) % (1 << 61)], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(tp.size)]
    dist.all_gather(every, mine, group=tp.ctrl)
    return all(torch.equal(x, every[0]) for x in every)


def serve_rank(engine: Any, tp: TPGroup) -> None:
    """Worker loop: run what rank 0 broadcasts until it says stop."""
    while True:
        cmd = _bcast_cmd(tp, None)
        op = cmd[0]
        if op == "stop":
            return
        if op == "inject":
            engine.inject(_recv_state(engine, tp, *cmd[1:]))
        elif op == "decode":
            _, first, max_tokens, sampling = cmd
            result = engine.decode(first, max_tokens, SamplingParams(**sampling), lambda t: None, SyncedCancel(tp, None))
            tokens_agree(tp, result.tokens)
        elif op == "reset":
            engine.reset()
        elif op == "warmup":
            engine.warmup()
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op!r}")


class TPEngine:
    """Rank 0's view of the N-rank engine, with the single-rank engine's API (INTERFACES §1)."""

    def __init__(self, engine: Any, tp: TPGroup, workers: list[subprocess.Popen]) -> None:
        self.local = engine
        self.tp = tp
        self.workers = workers
        self.config = engine.config
        self.device = engine.device
        self.max_seq_len = engine.max_seq_len
        self._lock = threading.Lock()
        self._closed = False

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def capabilities(self) -> dict[str, Any]:
        # decode() below does not carry logprobs/grammar to the ranks yet: not declared, so the router keeps such
        # requests on the native pool
        return {**self.local.capabilities, "tensor_parallel": True, "logprobs": False, "top_logprobs": False,
                "top_logprobs_max": 0, "structured_output": []}

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.local.cache_dtype

    @property
    def seq_len(self) -> int:
        return self.local.seq_len

    def health_problem(self) -> str | None:
        """Why this engine cannot serve (a worker rank exited), or None."""
        dead = [(r + 1, w.returncode) for r, w in enumerate(self.workers) if w.poll() is not None]
        if dead:
            return f"tensor-parallel worker rank(s) exited: {', '.join(f'rank {r} (exit {c})' for r, c in dead)}"
        return "tensor-parallel engine is closed" if self._closed else None

    def _check_workers(self) -> None:
        problem = self.health_problem()
        if problem:
            raise RuntimeError(problem)

    def _command(self, *cmd: Any) -> None:
        self._check_workers()
        _bcast_cmd(self.tp, list(cmd))

    @torch.no_grad()
    def warmup(self, max_windows: int | None = None) -> int:
        with self._lock:
            self._command("warmup")
            return self.local.warmup(max_windows)

    def reset(self) -> None:
        with self._lock:
            self._command("reset")
            self.local.reset()

    @torch.no_grad()
    def inject(self, state: KVState) -> None:
        """Place each rank's part of the full state: attention heads split in rank order, MLA latent whole."""
        caches = list(self.local.model.caches) + list(getattr(self.local.model, "mtp_caches", []))
        n = len(state.layers)
        if n > len(caches):
            raise ValueError(f"KVState has {n} layers, the model has {len(caches)}")
        if not 0 < state.seq_len < self.max_seq_len:
            raise ValueError(f"KVState seq_len {state.seq_len} must be in [1, max_seq_len={self.max_seq_len})")
        mla = self.config.family == "deepseek_v3"
        full_heads = 1 if mla else self.config.num_kv_heads
        for i, x in enumerate(state.layers):
            want = (state.seq_len, full_heads, caches[i].shape[2])
            if tuple(x.shape) != want:
                raise ValueError(f"KVState layer {i}: shape {list(x.shape)}, expected {list(want)}")
        self.local._check_indexer(state, n)  # refuse before any rank starts receiving
        indexed = None if state.indexer is None else [x is not None for x in state.indexer]
        with self._lock:
            self._command("inject", state.seq_len, n, indexed)
            mine = []
            for l, x in enumerate(state.layers):
                x = x.to(device=self.device, dtype=caches[l].dtype)
                if mla:
                    x = x.contiguous()
                    dist.broadcast(x, 0, group=self.tp.group)
                    mine.append(x)
                else:
                    parts = [p.contiguous() for p in x.chunk(self.tp.size, dim=1)]
                    out = torch.empty_like(parts[0])
                    dist.scatter(out, parts, src=0, group=self.tp.group)
                    mine.append(out)
            keys = self.local.model.index_cache_list() if indexed is not None else []
            indexer = None if indexed is None else []
            for l, x in enumerate(state.indexer or []):
                if x is not None:  # the indexer is replicated: every rank gets every key
                    x = x.to(device=self.device, dtype=keys[l].dtype).contiguous()
                    dist.broadcast(x, 0, group=self.tp.group)
                indexer.append(x)
            self.local.inject(KVState(state.seq_len, mine, indexer))

    @torch.no_grad()
    def decode(self, first_token: int, max_tokens: int, sampling: SamplingParams, on_token: Callable[[int], None],
               cancel: threading.Event | None = None) -> DecodeResult:
        if not sampling.greedy and sampling.seed is None:  # one seed for all ranks: the same draw everywhere
            sampling = SamplingParams(**{**asdict(sampling), "seed": random.getrandbits(62)})
        # A callback that raises must not leave rank 0's loop early while the workers step on: it stops
        # every rank at the next cancel check instead, and is re-raised once all ranks are done.
        failed: list[BaseException] = []
        stop = threading.Event()

        def emit(tok: int) -> None:
            if failed:
                return
            try:
                on_token(tok)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the ranks are in step again
                failed.append(exc)
                stop.set()

        class _Either:
            def is_set(self) -> bool:
                return stop.is_set() or (cancel is not None and cancel.is_set())

        with self._lock:
            self._command("decode", int(first_token), int(max_tokens), asdict(sampling))
            result = self.local.decode(first_token, max_tokens, sampling, emit, SyncedCancel(self.tp, _Either()))
            if not tokens_agree(self.tp, result.tokens):
                raise RuntimeError("tensor-parallel ranks decoded different tokens (lockstep lost); the engine must be restarted")
        if failed:
            raise failed[0]
        return result

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        with self._lock:
            try:
                if all(w.poll() is None for w in self.workers):
                    _bcast_cmd(self.tp, ["stop"])
            finally:
                self._closed = True
                for w in self.workers:
                    try:
                        w.wait(timeout=timeout_s)
                    except subprocess.TimeoutExpired:
                        w.kill()
                        w.wait()
                leave_group(self.local)


def leave_group(engine: Any, timeout_s: float = 10.0) -> None:
    """Drop the rank's CUDA graphs (they hold the NCCL communicator), then leave the process group.

    destroy_process_group() hung on H200s with graphs still captured around NCCL all-reduces; it runs
    in a daemon thread so a communicator that will not go away cannot hang the caller (the process
    is on its way out; the OS reclaims the rest).
    """
    if getattr(engine, "graph_step", None) is not None:
        engine.graph_step = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if not dist.is_initialized():
        return
    done = threading.Thread(target=dist.destroy_process_group, name="tp-leave-group", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("event=tp_leave_group_timeout seconds=%.0f", timeout_s)


def worker_argv(rank: int, size: int, port: int, options: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "tilepd.engine.tp_worker", "--rank", str(rank), "--size", str(size),
            "--store", f"{STORE_HOST}:{port}", "--options", json.dumps(options)]


def launch_tp_engine(weights_dir: Path, tp_size: int, device: str = "cpu", max_seq_len: int = 4096, dtype: str | None = None, *,
                     use_cuda_graph: bool | None = None, num_speculative_tokens: int | None = None, cpu_threads: int = 1) -> TPEngine:
    """Start ranks 1..tp_size-1 as worker processes, become rank 0, load every rank's shard."""
    from tilepd.engine.weights_loader import read_spec

    if tp_size < 2:
        raise ValueError("launch_tp_engine needs tp_size >= 2 (use load_engine for one rank)")
    if torch.device(device).type == "cuda" and torch.cuda.device_count() < tp_size:
        raise ValueError(f"tp_size {tp_size} needs {tp_size} GPUs, this host has {torch.cuda.device_count()}")
    local_spec(read_spec(Path(weights_dir)), tp_size)  # refuse an uneven split before starting anything
    store = dist.TCPStore(STORE_HOST, 0, world_size=tp_size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    options = {"weights_dir": str(weights_dir), "device": device, "max_seq_len": max_seq_len, "dtype": dtype,
               "use_cuda_graph": use_cuda_graph, "num_speculative_tokens": num_speculative_tokens, "cpu_threads": cpu_threads}
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    workers = [subprocess.Popen(worker_argv(r, tp_size, store.port, options), env=env) for r in range(1, tp_size)]
    try:
        tp = init_group(0, tp_size, store, device)
        engine = load_rank_engine(Path(weights_dir), tp, device, max_seq_len, dtype, use_cuda_graph=use_cuda_graph,
                                  num_speculative_tokens=num_speculative_tokens, cpu_threads=cpu_threads)
    except BaseException:
        for w in workers:
            w.kill()
            w.wait()
        leave_group(None)
        raise
    log.info("event=tp_ready tp_size=%d device=%s workers=%s", tp_size, device, [w.pid for w in workers])
    return TPEngine(engine, tp, workers)
