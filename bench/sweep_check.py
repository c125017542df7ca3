"""One tile config tried once before it is timed: shared by the GEMV tile sweeps (fp8_gemv_sweep, dense_gemv_sweep)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def config_ok(tune: dict[str, int], cfg: dict[str, int], run: Callable[[], torch.Tensor], ref: torch.Tensor, label: str,
              tol: float) -> bool:
    """Run `run` once with `tune` updated by `cfg` (restored after) and say whether its output lies within `tol` of `ref`
    (relative to ref's largest value); a config the compiler refuses or that computes wrong is printed with why."""
    saved = dict(tune)
    tune.update(cfg)
    try:
        y = run().float()
        err = float((y - ref).abs().max() / ref.abs().max())
    except Exception as e:  # noqa: BLE001 - a config the compiler refuses (registers, shared memory)
        print(f"  [{label}]: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return False
    finally:
        tune.clear()
        tune.update(saved)
    if err > tol:
        print(f"  [{label}]: error {err:.2e} TOO LARGE", flush=True)
        return False
    return True
