"""Tensor-parallel tests: tiny models converted for tp 1 and tp 2 (fp32, so ranks compare closely)."""

from __future__ import annotations

from pathlib import Path

import pytest


def convert(model_dir: Path, out: Path, tp: int) -> Path:
    from tilepd.weights.convert import convert_weights

    convert_weights(model_dir, out, dtype="fp32", tp=tp, progress=False)
    return out


@pytest.fixture(scope="session")
def tp_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("tp-llama")
    return {tp: convert(tiny_llama, root / f"tp{tp}", tp) for tp in (1, 2)}


@pytest.fixture(scope="session")
def tp_deepseek(tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("tp-deepseek")
    return {tp: convert(tiny_deepseek, root / f"tp{tp}", tp) for tp in (1, 2)}

