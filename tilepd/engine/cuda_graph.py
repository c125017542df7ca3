"""The whole decode step (model forward + sampler + position increment) as one CUDA graph replay.

Inputs live in static device buffers (StepIO: token, position); the step writes the sampled token back
into the token buffer and adds one to the position on device, so consecutive replays need no host
writes and the only host sync per token is reading the token id. Attention runs over a static cache
window with a length mask; windows come in geometric buckets (one graph per bucket and per
greedy/sampling), so a 1K-token request does not read a 128K-token cache. Graphs are captured lazily
on first use of a bucket (or all at once by `warmup`) and share one memory pool.

Without CUDA (`capture=False`) the same static-shape body runs eagerly, which is how CPU tests check it.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from tilepd.engine.sampling import SamplerState, greedy

log = logging.getLogger(__name__)


def capture_graph(body: Callable[[], None], state: list[torch.Tensor], pool=None) -> torch.cuda.CUDAGraph:
    """Capture `body` (two warm-up runs on a side stream first: lazy inits, cuBLAS handles, Triton builds),
    restoring the static `state` buffers the body advances after every run, so capturing changes nothing."""
    saved = [t.clone() for t in state]

    def restore() -> None:
        for t, v in zip(state, saved):
            t.copy_(v)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
            restore()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    restore()
    return graph


def default_buckets(max_seq_len: int, smallest: int = 256, ratio: float = 1.25, align: int = 256) -> list[int]:
    """Cache windows ~25% apart, multiples of `align`, ending exactly at max_seq_len."""
    out: list[int] = []
    n = smallest
    while n < max_seq_len:
        out.append(n)
        n = max(n + align, int(n * ratio) // align * align)
    out.append(max_seq_len)
    return out


class GraphStep:
    """Callable like EagerStep: (io, pos, use_greedy) -> the token buffer holding the new token."""

    def __init__(self, model, sampler: SamplerState, io, max_seq_len: int, *, buckets: list[int] | None = None, capture: bool | None = None) -> None:
        self.model = model
        self.sampler = sampler
        self.io = io
        self.buckets = buckets or default_buckets(max_seq_len)
        self.capture = io.token.device.type == "cuda" if capture is None else capture
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_error: str | None = None
        self.fallbacks: list[Callable[[], str]] = []  # compiled.accelerate's undo steps, tried in order

    def window(self, needed: int) -> int:
        return self.buckets[min(bisect.bisect_left(self.buckets, needed), len(self.buckets) - 1)]

    def _body(self, attn_len: int, use_greedy: bool) -> None:
        io = self.io
        logits, _ = self.model.forward(io.token, io.position, attn_len)
        nxt = greedy(logits[-1:]) if use_greedy else self.sampler(logits[-1])
        io.token.copy_(nxt.view(1))
        io.position.add_(1)

    def __call__(self, io, pos: int, use_greedy: bool) -> torch.Tensor:
        attn_len = self.window(pos + 1)
        if not self.capture:
            self._body(attn_len, use_greedy)
            return io.token
        graph = self.graphs.get((attn_len, use_greedy))
        if graph is None:
            graph = self._capture_or_fall_back(attn_len, use_greedy)
            if graph is None:  # never fail a request over a graph: run the same body uncaptured
                self._body(attn_len, use_greedy)
                return io.token
        graph.replay()
        return io.token

    def _capture_or_fall_back(self, attn_len: int, use_greedy: bool) -> torch.cuda.CUDAGraph | None:
        """Capture; on failure undo one speed-path step (compiled.accelerate) and retry, then give up on graphs."""
        while True:
            token, position = self.io.token.clone(), self.io.position.clone()
            try:
                return self._capture(attn_len, use_greedy)
            except Exception as e:  # noqa: BLE001 - a capture that fails for any reason falls back (logged), never fails the decode
                torch.cuda.synchronize()
                self.io.token.copy_(token)
                self.io.position.copy_(position)
                self.capture_error = f"{type(e).__name__}: {e}"
                if not self.fallbacks:
                    log.warning("event=cuda_graph_capture_failed window=%d error=%s; decoding without graphs", attn_len, e)
                    self.capture = False
                    return None
                what = self.fallbacks.pop(0)()
                self.graphs.clear()  # graphs captured so far may hold the path just undone
                log.warning("event=speed_path_fallback window=%d error=%s; %s", attn_len, e, what)

    def _capture(self, attn_len: int, use_greedy: bool) -> torch.cuda.CUDAGraph:
        graph = capture_graph(lambda: self._body(attn_len, use_greedy), [self.io.token, self.io.position], self.pool)
        self.pool = graph.pool()
        self.graphs[(attn_len, use_greedy)] = graph
        return graph

    def warmup(self, use_greedy: bool = True, max_windows: int | None = None) -> int:
        """Capture the graphs of every window up front (the cache content at position 0 is scratch here)."""
        if not self.capture:
            return 0
        saved_tok, saved_pos = self.io.token.clone(), self.io.position.clone()
        self.io.position.zero_()
        for n in self.buckets[:max_windows]:
            if (n, use_greedy) not in self.graphs and self._capture_or_fall_back(n, use_greedy) is None:
                break
        self.io.token.copy_(saved_tok)
        self.io.position.copy_(saved_pos)
        torch.cuda.synchronize()
        return len(self.graphs)
