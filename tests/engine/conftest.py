"""Engine test fixtures: HF reference runs shared by the module tests."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tilepd.dev.hf_reference import Reference, hf_reference

STEPS = 64


@contextmanager
def one_torch_thread():
    """Tiny batch-1 models run ~50x faster on one thread when the 2 cores are shared with other tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def llama_ref(tiny_llama: Path) -> Reference:
    with one_torch_thread():
        return hf_reference(tiny_llama, "llama", STEPS)


@pytest.fixture(scope="session")
def deepseek_ref(tiny_deepseek: Path) -> Reference:
    with one_torch_thread():
        return hf_reference(tiny_deepseek, "deepseek_v3", STEPS)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield
