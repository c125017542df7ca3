"""A TilePDConnector worker half without vLLM's engine, for driving its hooks step by step in unit tests.

Built without `__init__` (which needs a full VllmConfig) and without a sender thread: a test takes a staged job off
`_jobs` itself, as the sender would.
"""

from __future__ import annotations

import queue
import threading

import torch

from tilepd.connector.events import EventLog
from tilepd.connector.paged_cache import ModelCacheFacts, read_paged_cache
from tilepd.connector.staging import StagingPool
from tilepd.connector.vllm_connector import SendSpec, TilePDConnector
from tilepd.contracts.marker import TilepdMarker


def bare_worker(caches: dict[str, torch.Tensor], block: int, num_slots: int, max_seq_len: int) -> TilePDConnector:
    """The worker half over `caches` (vLLM-shaped [blocks, H, block, K|V] float32 views, head size 32)."""
    pc = read_paged_cache(caches, ModelCacheFacts(False, "auto", block, head_size=32))
    c = TilePDConnector.__new__(TilePDConnector)
    c.events = EventLog("worker")
    c._cache = pc
    c._pool = StagingPool(pc.layout, max_seq_len=max_seq_len, num_slots=num_slots)
    c._layer_index = {n: i for i, n in enumerate(pc.layer_names)}
    c._step = None
    c._inflight = {}
    c._jobs = queue.Queue()
    c._released, c._released_lock, c._staging_wait_s = [], threading.Lock(), 0.05
    return c


def send_spec(rid: str, blocks: list[int], start: int, end: int, seq_len: int) -> SendSpec:
    """The scheduler's SendSpec for tokens [start, end) of request `rid` (final when end reaches seq_len)."""
    m = TilepdMarker(host="127.0.0.1", ctrl_port=1, transfer_id=f"t-{rid}", token="x")
    return SendSpec(rid, m, seq_len, blocks, start, end, end >= seq_len)
