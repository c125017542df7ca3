"""Tile settings shared by the Triton kernels: env overrides read once, and BLOCK_N picked to fill the GPU."""

from __future__ import annotations

import os


def env_int(name: str, default: int) -> int:
    """An integer tile setting from the environment (empty or unset: the default); anything else is refused by name."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer") from None


def pick_block_n(n: int, rows: int, *, forced: int, programs: int, smallest: int) -> int:
    """The largest of 64/32/16 output rows per program that still launches `programs` programs over `rows` GEMVs
    of `n` outputs (batch-1 GEMVs need many programs to keep every SM reading); `forced` > 0 wins."""
    if forced:
        return forced
    for b in (64, 32, 16):
        if -(-n // b) * rows >= programs:
            return b
    return smallest
