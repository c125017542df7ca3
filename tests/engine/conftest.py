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


# DSA (sparse attention) tiny models and their HF references: a prompt shorter than index_topk (16) and one
# 5x longer (80 tokens), random ids so every position is a real token.
DSA_STEPS = 24
DSA_PROMPTS = {"short": 10, "long": 80}


def dsa_prompt(kind: str) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(5, 500, (DSA_PROMPTS[kind],), generator=g).tolist()


@pytest.fixture(scope="session")
def tiny_glm5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tilepd.dev.tiny_model import make_tiny_model

    return make_tiny_model("glm5", tmp_path_factory.mktemp("tiny-glm5"))


@pytest.fixture(scope="session")
def tiny_dsv32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tilepd.dev.tiny_model import make_tiny_model

    return make_tiny_model("dsv32", tmp_path_factory.mktemp("tiny-dsv32"))


_DSA_REFS: dict[tuple[str, str], Reference] = {}


@pytest.fixture(scope="session")
def dsa_ref(request: pytest.FixtureRequest):
    """dsa_ref(model, prompt) -> HF greedy reference of tiny model "glm5"/"dsv32" on the "short"/"long" prompt (cached)."""

    def get(model: str, kind: str) -> Reference:
        if (model, kind) not in _DSA_REFS:
            path = request.getfixturevalue(f"tiny_{model}")
            with one_torch_thread():
                _DSA_REFS[(model, kind)] = hf_reference(path, model, DSA_STEPS, prompt_ids=dsa_prompt(kind))
        return _DSA_REFS[(model, kind)]

    return get
