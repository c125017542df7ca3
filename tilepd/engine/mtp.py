"""Greedy speculative decode with DeepSeek-V3's MTP layer as one static step (a CUDA graph on CUDA).

One step, all on device, static shapes (k = num_speculative_tokens):
  1. verify: the target runs [pending, d1..dk] at positions P..P+k in one forward; out = argmax per row;
  2. accept: n = length of the prefix where d_{j+1} == out[j] (0 on a request's first step, which has no
     drafts yet); the step emits out[0..n] and out[n] becomes the next pending token at P+n+1;
  3. draft: the MTP layer catches up on all k+1 rows (token out[j] with the target's hidden state of
     P+j, at position P+j, as vLLM runs it); row n's argmax is d1, then k-1 more MTP steps (its single
     layer reused recursively) draft d2..dk at positions P+n+1...
Rejected rows need no rollback: every slot they wrote (target, MTP and indexer caches) lies past the next
step's P' = P+n+1 and is rewritten by that step before anything reads it; the length mask hides the rest.
The host reads one small tensor per step ([n, matched, out...]: one sync) and emits out[0..n]. Output is
exactly plain greedy decoding; only the number of target steps changes. Near the end of the cache (where
the drafts would run past it) the decode finishes with plain steps, which give the same tokens.

Bench/test mode (`set_oracle`): drafts come from a device table of known tokens (the draft layer still
runs, so its cost is measured), and `force` counts every draft as accepted (cost of full acceptance).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable

import torch

from tilepd.engine.cuda_graph import capture_graph
from tilepd.engine.sampling import greedy
from tilepd.engine.types import DecodeResult, FinishReason

log = logging.getLogger(__name__)


class MtpStep:
    """The static verify + accept + draft step over the engine's StepIO (token = pending, position = P).

    `plain` is the engine's GraphStep (or None): its window buckets and speed-path fallbacks are shared."""

    def __init__(self, model, k: int, max_seq_len: int, io, plain=None, *, capture: bool = False) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 for the MTP step, got {k}")
        dev = io.token.device
        self.model, self.k, self.max_seq_len, self.io, self.plain = model, k, max_seq_len, io, plain
        self.capture = capture
        self.drafts = torch.zeros(k, dtype=torch.long, device=dev)  # what the next step verifies
        self.mtp_drafts = torch.zeros(k, dtype=torch.long, device=dev)  # what the MTP layer drafted (= drafts without an oracle)
        self.first = torch.ones(1, dtype=torch.long, device=dev)  # 1: no drafts yet (a request's first step)
        self.result = torch.zeros(k + 3, dtype=torch.long, device=dev)  # [n, matched, out_0..out_k]
        self.offsets = torch.arange(k + 1, device=dev)
        self.oracle: torch.Tensor | None = None
        self._oracle_buf: torch.Tensor | None = None
        self.force = False
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_error: str | None = None

    def fits(self, pos: int) -> bool:
        """Whether a step at P=pos stays inside the cache (verify up to P+k, drafts up to P+2k-1)."""
        return pos + 2 * self.k <= self.max_seq_len

    def window(self, pos: int) -> int:
        needed = pos + 2 * self.k
        if self.plain is None:  # no graph step (eager engine): the live prefix, like EagerStep
            return needed
        buckets = self.plain.buckets
        return buckets[min(bisect.bisect_left(buckets, needed), len(buckets) - 1)]

    def set_oracle(self, tokens: list[int] | None, *, force: bool = False) -> None:
        """Bench/tests: drafts := tokens[P+1..P+k] (tokens[i] = the token fed at position i), optionally all accepted."""
        if tokens is None:
            self.oracle, self.force = None, False
            return
        if self._oracle_buf is None:  # one buffer for good: captured graphs hold its address
            self._oracle_buf = torch.zeros(self.max_seq_len, dtype=torch.long, device=self.drafts.device)
        n = min(len(tokens), self.max_seq_len)
        self._oracle_buf.zero_()
        self._oracle_buf[:n] = torch.tensor(tokens[:n], dtype=torch.long)
        self.oracle, self.force = self._oracle_buf, force

    def _state(self) -> list[torch.Tensor]:
        return [self.io.token, self.io.position, self.drafts, self.mtp_drafts, self.first, self.result]

    def _body(self, attn_len: int) -> None:
        io, k, model = self.io, self.k, self.model
        pos = io.position + self.offsets  # [k+1]
        logits, hs = model.forward(torch.cat([io.token, self.drafts]), pos, attn_len)
        out = greedy(logits)  # [k+1]
        matched = (self.drafts == out[:k]).long().cumprod(0).sum().view(1)
        n = torch.full_like(matched, k) if self.force else matched
        n = n * (1 - self.first)
        self.first.zero_()
        self.result.copy_(torch.cat([n, matched, out]))
        mlogits, mh = model.mtp_forward(out, hs, pos, attn_len, head_rows=n)
        d = greedy(mlogits)  # [1]
        h = mh.index_select(0, n)
        drafts = [d]
        base = io.position + n
        for j in range(1, k):
            mlogits, h = model.mtp_forward(d, h, base + j, attn_len)
            d = greedy(mlogits)
            drafts.append(d)
        io.token.copy_(out.index_select(0, n))
        io.position.add_(n + 1)
        self.mtp_drafts.copy_(torch.cat(drafts))
        if self.oracle is None:
            self.drafts.copy_(self.mtp_drafts)
        else:
            self.drafts.copy_(self.oracle.index_select(0, (io.position + self.offsets[1:]).clamp(max=self.max_seq_len - 1)))

    def __call__(self, pos: int) -> list[int]:
        """One step at P=pos; returns [n, matched, out_0..out_k] (the step's only host sync)."""
        attn_len = self.window(pos)
        if not self.capture:
            self._body(attn_len)
            return self.result.tolist()
        key = (attn_len, self.oracle is not None, self.force)
        graph = self.graphs.get(key) or self._capture_or_fall_back(key)
        if graph is None:  # never fail a request over a graph: run the same body uncaptured
            self._body(attn_len)
        else:
            graph.replay()
        return self.result.tolist()

    def _capture_or_fall_back(self, key: tuple[int, bool, bool]) -> torch.cuda.CUDAGraph | None:
        """Capture; on failure undo one speed-path step (the plain GraphStep's list, shared) and retry."""
        fallbacks = self.plain.fallbacks if self.plain is not None else []
        while True:
            saved = [t.clone() for t in self._state()]
            try:
                graph = capture_graph(lambda: self._body(key[0]), self._state(), self.pool)
                self.pool = graph.pool()
                self.graphs[key] = graph
                return graph
            except Exception as e:  # noqa: BLE001 - a capture that fails for any reason falls back (logged), never fails the decode
                torch.cuda.synchronize()
                for t, v in zip(self._state(), saved):
                    t.copy_(v)
                self.capture_error = f"{type(e).__name__}: {e}"
                if not fallbacks:
                    log.warning("event=mtp_graph_capture_failed window=%d error=%s; MTP steps without graphs", key[0], e)
                    self.capture = False
                    return None
                what = fallbacks.pop(0)()
                self.graphs.clear()
                self.plain.graphs.clear()
                log.warning("event=speed_path_fallback window=%d error=%s; %s", key[0], e, what)

    def warmup(self, max_windows: int | None = None) -> int:
        """Capture the step's graph for every window up front (the cache near position 0 is scratch here)."""
        if not self.capture or self.plain is None:
            return 0
        saved = [t.clone() for t in self._state()]
        self.io.position.zero_()
        for n in self.plain.buckets[:max_windows]:
            if n < 2 * self.k:
                continue
            if (n, False, False) not in self.graphs and self._capture_or_fall_back((n, False, False)) is None:
                break
        for t, v in zip(self._state(), saved):
            t.copy_(v)
        torch.cuda.synchronize()
        return len(self.graphs)


def mtp_step(engine) -> MtpStep:
    """The engine's MtpStep for its current num_speculative_tokens (built on first use)."""
    step = getattr(engine, "_mtp_step", None)
    if step is None or step.k != engine.num_speculative_tokens:
        plain = engine.graph_step
        step = MtpStep(engine.model, engine.num_speculative_tokens, engine.max_seq_len, engine.io, plain,
                        capture=plain is not None and plain.capture)
        engine._mtp_step = step
    return step


def mtp_decode(engine, first_token: int, max_tokens: int, stops: set[int], on_token: Callable[[int], None],
               cancel: threading.Event | None) -> DecodeResult:
    """Greedy decode through MtpStep (plain steps only where the drafts would run past the cache)."""
    step = mtp_step(engine)
    plain = engine.graph_step or engine.eager_step
    io, k = engine.io, step.k
    tokens: list[int] = []
    reason: FinishReason | None = None
    drafted = accepted = matched = target_steps = 0
    t0 = time.perf_counter()
    t_first = 0.0

    def emit(tok: int) -> bool:
        nonlocal reason, t_first
        if not tokens:
            t_first = time.perf_counter() - t0
        tokens.append(tok)
        on_token(tok)
        if tok in stops:
            reason = "stop"
        elif len(tokens) >= max_tokens:
            reason = "length"
        return reason is not None

    p = engine.seq_len
    io.token.fill_(int(first_token))
    io.position.fill_(p)
    step.first.fill_(1)
    fresh = True
    if max_tokens <= 0:
        reason = "length"
    while reason is None:
        if cancel is not None and cancel.is_set():
            reason = "cancelled"
            break
        if p >= engine.max_seq_len:
            reason = "length"
            break
        target_steps += 1
        if not step.fits(p):  # the last few positions: plain steps (same greedy tokens)
            tok = int(plain(io, p, True).item())
            p += 1
            emit(tok)
            continue
        res = step(p)
        n = res[0]
        if fresh:  # the first step had no drafts to verify
            fresh = False
        else:
            drafted += k
            accepted += n
            matched += res[1]
        for tok in res[2 : 3 + n]:
            p += 1
            if emit(tok):
                break
    engine.seq_len = min(p, engine.max_seq_len)
    elapsed = time.perf_counter() - t0
    rate = accepted / drafted if drafted else 0.0
    engine.last_mtp_stats = {"drafted": drafted, "accepted": accepted, "acceptance_rate": rate, "target_steps": target_steps,
                              "matched": matched}
    timings = {"decode_ms": elapsed * 1e3, "first_step_ms": t_first * 1e3,
               "ms_per_token": elapsed / len(tokens) * 1e3 if tokens else 0.0,
               "tokens": float(len(tokens)), "drafted": float(drafted), "accepted": float(accepted),
               "acceptance_rate": rate, "target_steps": float(target_steps)}
    return DecodeResult(tokens, reason or "length", timings)
