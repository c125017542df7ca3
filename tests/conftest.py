"""Shared fixtures. Heavy artefacts (tiny models) are made once per session, at test time."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest_plugins = ["tests._ci_watch"]  # suite budget, early failure lines, a machine snapshot for long tests


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def python_exe() -> str:
    """The interpreter of the test environment: real processes (vLLM, servers) are started with it."""
    return sys.executable


def _tiny_model(tmp_path_factory: pytest.TempPathFactory, family: str, **kwargs) -> Path:
    from tilepd.dev.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp(f"tiny-{family}")
    return make_tiny_model(family, out, **kwargs)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF-format tiny random Llama (config.json, model.safetensors, tokenizer files)."""
    return _tiny_model(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF-format tiny random DeepSeek-V3 (MLA 512+64, MoE, noaux_tc, with an MTP layer)."""
    return _tiny_model(tmp_path_factory, "deepseek_v3")


def pytest_configure(config: pytest.Config) -> None:
    # Never reach a hub from tests: every model is generated locally.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def _cuda_missing() -> str | None:
    """Why the `gpu` tests cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "needs torch with a CUDA device (torch is not installed)"
    return None if torch.cuda.is_available() else "needs a CUDA device (marker gpu; run on the GPU machine: pytest -m gpu)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    why = _cuda_missing() if gpu else None
    for item in gpu if why else ():
        item.add_marker(pytest.mark.skip(reason=why))
