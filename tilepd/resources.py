"""Locate files that ship with tilepd, whether installed from a wheel or run from a checkout."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _bundled(name: str) -> Path:
    # A wheel carries them under tilepd/_bundled/<name>; a checkout keeps them at the repo root.
    for candidate in (_PKG / "_bundled" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"tilepd resource folder {name!r} not found under {_PKG} (broken install?)")


def playbooks_dir() -> Path:
    return _bundled("playbooks")


def examples_dir() -> Path:
    return _bundled("topology_examples")
