"""Greedy speculative decode with DeepSeek-V3's MTP layer: draft k tokens, verify them in one target step.

Round: the MTP module drafts d1..dk (reusing its single layer recursively, as vLLM does); the target runs
[pending, d1..dk] at positions P..P+k in one forward; the longest prefix where d_{j+1} equals the target's
argmax is accepted, plus the target's own next token. Rejected positions need no rollback: the static
cache is overwritten later and the length mask hides slots past the current position. Output is exactly
plain greedy decoding; only the number of target steps changes.

The MTP layer then catches up on the accepted positions with the target's hidden states (so its own cache
holds the right entries), and its last output is the next round's first draft.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from tilepd.engine.types import DecodeResult, FinishReason

# A drafter override (tests): (tokens emitted so far, k) -> k draft ids. None = the model's MTP layer.
Drafter = Callable[[list[int], int], list[int]]


def _mtp_drafts(model, toks: list[int], hidden: torch.Tensor, positions: list[int], k: int) -> list[int]:
    dev = hidden.device
    pos = torch.tensor(positions, device=dev)
    logits, h = model.mtp_forward(torch.tensor(toks, device=dev), hidden, pos, positions[-1] + 1)
    drafts = [int(torch.argmax(logits[-1]))]
    last_pos, last_h = positions[-1], h[-1:]
    for j in range(1, k):
        p = last_pos + j
        logits, last_h = model.mtp_forward(torch.tensor(drafts[-1:], device=dev), last_h, torch.tensor([p], device=dev), p + 1)
        drafts.append(int(torch.argmax(logits[-1])))
    return drafts


def speculative_decode(engine, first_token: int, max_tokens: int, stops: set[int], on_token: Callable[[int], None],
                       cancel: threading.Event | None) -> DecodeResult:
    model, dev = engine.model, engine.device
    drafter: Drafter | None = getattr(engine, "drafter", None)
    k_max = engine.num_speculative_tokens
    tokens: list[int] = []
    reason: FinishReason | None = None
    drafted = accepted = target_steps = 0
    t0 = time.perf_counter()

    def emit(tok: int) -> bool:
        nonlocal reason
        tokens.append(tok)
        on_token(tok)
        if tok in stops:
            reason = "stop"
        elif len(tokens) >= max_tokens:
            reason = "length"
        return reason is not None

    p = engine.seq_len
    if max_tokens <= 0 or (cancel is not None and cancel.is_set()):
        reason = "cancelled" if max_tokens > 0 else "length"
    else:
        logits, h = model.forward(torch.tensor([first_token], device=dev), torch.tensor([p], device=dev), p + 1)
        target_steps += 1
        g = int(torch.argmax(logits[-1]))
        emit(g)
        hidden, toks, mtp_pos = h, [g], [p]
        p += 1
    while reason is None:
        if cancel is not None and cancel.is_set():
            reason = "cancelled"
            break
        k = min(k_max, engine.max_seq_len - 1 - p)
        if k < 0:
            reason = "length"
            break
        drafts = [] if k == 0 else (drafter(list(tokens), k) if drafter else _mtp_drafts(model, toks, hidden, mtp_pos, k))
        ids = torch.tensor([toks[-1], *drafts], device=dev)
        logits, hs = model.forward(ids, torch.arange(p, p + k + 1, device=dev), p + k + 1)
        target_steps += 1
        out = torch.argmax(logits, dim=-1).tolist()
        n = 0
        while n < k and drafts[n] == out[n]:
            n += 1
        drafted += k
        accepted += n
        for j in range(n + 1):
            if emit(out[j]):
                break
        hidden, toks, mtp_pos = hs[: n + 1], out[: n + 1], list(range(p, p + n + 1))
        p += n + 1
    engine.seq_len = min(p, engine.max_seq_len)
    elapsed = time.perf_counter() - t0
    rate = accepted / drafted if drafted else 0.0
    engine.last_spec_stats = {"drafted": drafted, "accepted": accepted, "acceptance_rate": rate, "target_steps": target_steps}
    timings = {"decode_ms": elapsed * 1e3, "ms_per_token": elapsed / len(tokens) * 1e3 if tokens else 0.0,
               "tokens": float(len(tokens)), "drafted": float(drafted), "accepted": float(accepted),
               "acceptance_rate": rate, "target_steps": float(target_steps)}
    return DecodeResult(tokens, reason or "length", timings)
