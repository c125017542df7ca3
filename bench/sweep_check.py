"""One tile config tried once before it is timed: shared by the GEMV tile sweeps (fp8_gemv_sweep, dense_gemv_sweep)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def tune_override(tune: dict[str, int], cfg: dict[str, int]) -> Iterator[None]:
    """A kernel module's TUNE with cfg over its current values, put back after (a sweep times each config this way)."""
    saved = dict(tune)
    tune.update(cfg)
    try:
        yield
    finally:
        tune.clear()
        tune.update(saved)


def config_ok(tune: dict[str, int], cfg: dict[str, int], run: Callable[[], torch.Tensor], ref: torch.Tensor, label: str,
              tol: float) -> bool:
    """Run `run` once with `tune` updated by `cfg` (restored after) and say whether its output lies within `tol` of `ref`
    (relative to ref's largest value); a config the compiler refuses or that computes wrong is printed with why."""
    try:
        with tune_override(tune, cfg):
            y = run().float()
        err = float((y - ref).abs().max() / ref.abs().max())
    except Exception as e:  # noqa: BLE001 - a config the compiler refuses (registers, shared memory)
        print(f"  [{label}]: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return False
    if err > tol:
        print(f"  [{label}]: error {err:.2e} TOO LARGE", flush=True)
        return False
    return True
