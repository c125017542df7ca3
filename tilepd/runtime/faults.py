"""Test-only faults the real node cannot be made to show from outside, read from the environment once.

`TILEPD_FAULT_DECODE_TOKEN_S` (test only: nothing in a deployment sets it) holds the engine's worker thread that
many seconds after each generated token: a slow accelerator on demand, so a test that needs a decode still running
when something happens to it (a client leaving mid-stream) creates that condition instead of hoping the machine is
slow. The wedge of the serving loop is the other such fault (`tilepd.runtime.liveness.WEDGE_ENV`).

`TILEPD_FAULT_SCALE_WEIGHTS=PREFIX=FACTOR` (test only) multiplies, once the engine is loaded, every weight whose name
starts with PREFIX (e.g. `layers.1.` for one layer) by FACTOR, in place: an engine whose numerics left the prefill's
(a wrong kernel, a bad conversion) with the same checkpoint fingerprint, which the canary and the router's divergence
watch must catch. It scales the tensors the model was built from; a CUDA speed path that concatenated copies of them
at load is not covered (the tests run on CPU).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping

log = logging.getLogger("tilepd.runtime")

SLOW_TOKEN_ENV = "TILEPD_FAULT_DECODE_TOKEN_S"
SCALE_WEIGHTS_ENV = "TILEPD_FAULT_SCALE_WEIGHTS"


def slow_token_delay(env: Mapping[str, str] = os.environ) -> float:
    """The per-token hold the environment asks for (0.0: none); a value that is not a number >= 0 is refused."""
    raw = env.get(SLOW_TOKEN_ENV, "")
    if not raw:
        return 0.0
    try:
        delay = float(raw)
    except ValueError:
        raise ValueError(f"{SLOW_TOKEN_ENV}={raw!r}: not a number of seconds") from None
    if not 0.0 <= delay <= 10.0:
        raise ValueError(f"{SLOW_TOKEN_ENV}={raw!r}: must be between 0 and 10 seconds")
    log.warning("event=fault_injected fault=slow_decode token_s=%s (test only)", delay)
    return delay


def slowed(on_token: Callable[[int], None], delay_s: float) -> Callable[[int], None]:
    """`on_token`, then a sleep of `delay_s` on the engine's thread (so the next step starts that much later)."""
    if delay_s <= 0.0:
        return on_token

    def held(token: int) -> None:
        on_token(token)
        time.sleep(delay_s)

    return held


def weight_scaling(env: Mapping[str, str] = os.environ) -> tuple[str, float] | None:
    """(prefix, factor) the environment asks to scale weights by, or None; a malformed value is refused."""
    raw = env.get(SCALE_WEIGHTS_ENV, "")
    if not raw:
        return None
    prefix, sep, factor = raw.rpartition("=")
    try:
        value = float(factor)
    except ValueError:
        value = float("nan")
    if not sep or not prefix or value != value:
        raise ValueError(f"{SCALE_WEIGHTS_ENV}={raw!r}: expected PREFIX=FACTOR, e.g. layers.1.=0.5")
    return prefix, value


def perturb_weights(engine: Any, env: Mapping[str, str] = os.environ) -> int:
    """Scale the engine's weights as `SCALE_WEIGHTS_ENV` asks (module docstring); returns how many tensors changed."""
    asked = weight_scaling(env)
    if asked is None:
        return 0
    prefix, factor = asked
    weights = getattr(getattr(engine, "model", None), "w", None)
    if not isinstance(weights, dict):
        raise ValueError(f"{SCALE_WEIGHTS_ENV}: this engine ({type(engine).__name__}) holds no weights dict to scale")
    names = sorted(n for n, t in weights.items() if n.startswith(prefix) and hasattr(t, "mul_"))
    if not names:
        raise ValueError(f"{SCALE_WEIGHTS_ENV}: no dense weight starts with {prefix!r}")
    for name in names:
        weights[name].mul_(factor)
    log.warning("event=fault_injected fault=scale_weights prefix=%s factor=%s tensors=%d (test only)", prefix, factor, len(names))
    return len(names)
