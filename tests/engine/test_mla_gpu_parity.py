"""GPU parity (marker gpu): the MLA kernel and the expert GEMV give the reference path's greedy tokens (float32, tiny shapes).

For a tiny DeepSeek-V3 (dense MLA, bf16-style dense experts) and a tiny GLM-5 (DSA: index_topk 16, so a
300-token context really attends sparsely), both with random weights built on the device (no download, no
HF), each injected with the same random prefix state (40 and 300 tokens):
  - `graph`: CUDA graphs, MLA and experts on the reference path (SDPA / gather+matmul, gather+einsum): the reference;
  - `speed-path`: compiled.accelerate (MLA kernel + expert GEMV + router kernel) in CUDA graphs, windows changing mid-run;
  - `speed-path+mtp` / `+mtp3`: the same kernels in the MTP step's CUDA graphs (mtp.MtpStep, k=1 / k=3:
    verify steps of 2 / 4 tokens); `+mtp3-oracle`: k=3 with drafts from the reference tokens, every 5th wrong
    (accepted and rejected drafts in one run; the random MTP layer alone is almost never accepted).
A tiny Llama goes through its speed path too (split-KV attention, the per-layer functions compiled with
compiled.SPEED_COMPILE_OPTIONS). float32 everywhere, so the greedy tokens must be identical.

    pytest -m gpu tests/engine/test_mla_gpu_parity.py     # was `python bench/mla_gpu_parity.py --tokens 48`
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the benches' shape table (bench/kit.py)

from kit import TINY_DSV3, TINY_GLM5, TINY_LLAMA, random_state

pytestmark = pytest.mark.gpu

TOKENS = 48
DEVICE = "cuda"  # where the checks run (a dry run of this file's own logic can set cpu: the graphs' static body, eagerly)
MODELS = {"llama-tiny": TINY_LLAMA, "dsv3-tiny": TINY_DSV3, "glm5-tiny": TINY_GLM5}
CONTEXTS = (40, 300)
DEEPSEEK_VARIANTS = ("speed-path", "speed-path+mtp", "speed-path+mtp3", "speed-path+mtp3-oracle")
CASES = [(name, context, variant) for name in MODELS for context in CONTEXTS
         for variant in (("speed-path",) if name == "llama-tiny" else DEEPSEEK_VARIANTS)]


def _decode(spec, weights, device, variant: str, context: int, tokens: int, oracle: list[int] | None = None) -> tuple[list[int], str]:
    from tilepd.engine import layers, moe
    from tilepd.engine import mla_fused
    from tilepd.engine.compiled import accelerate, reference_path
    from tilepd.engine.engine import Engine, build_model
    from tilepd.engine.types import SamplingParams

    reference_path()
    max_seq = context + tokens + 64
    model = build_model(spec, weights, max_seq, device, torch.float32)
    # Llama's speed path compiles its per-layer functions (Inductor's coordinate descent); the DeepSeek family has no compiled part
    path = accelerate(model, compile_layers=spec.family == "llama") if variant.startswith("speed-path") else None
    mtp = "+mtp" in variant
    engine = Engine(model, spec, device, max_seq, use_cuda_graph=True, num_speculative_tokens=(3 if "+mtp3" in variant else 1) if mtp else 0)
    if engine.graph_step is not None:
        engine.graph_step.buckets = [context + 8, context + 24, max_seq]  # windows change during the run
        engine.graph_step.fallbacks = list(path.fallbacks) if path is not None else []
    if oracle is not None:
        from tilepd.engine.mtp import mtp_step

        mtp_step(engine).set_oracle([0] * context + [3] + [(t + 1) % spec.vocab_size if i % 5 == 4 else t for i, t in enumerate(oracle)])
    engine.inject(random_state(spec, context, device, torch.float32))
    res = engine.decode(3, tokens, SamplingParams(ignore_eos=True), lambda t: None)
    gs = engine.graph_step
    note = (f"path={path.name if path else 'plain'} switches=mla:{layers.ATTENTION_IMPL['mla']},experts:{moe.EXPERT_IMPL['dense']},"
            f"router:{moe.ROUTE_IMPL['router']},moe-block:{moe.BLOCK_IMPL['moe']},mla-fused:{mla_fused.FUSED_IMPL['attention']}")
    if gs is not None and gs.capture_error:
        note += f" capture_error={gs.capture_error[:120]}"
    if mtp:
        note += f" spec={engine.last_mtp_stats} mtp_graphs={len(engine._mtp_step.graphs)}"
        if engine._mtp_step.capture_error:
            note += f" capture_error={engine._mtp_step.capture_error[:120]}"
    reference_path()
    return res.tokens, note


@pytest.fixture(scope="module")
def reference() -> Callable[[str, int], tuple]:
    """(spec, weights, reference tokens) of a model at a context, built once per module on the device."""
    from tilepd.dev.synthetic import random_runtime_weights
    from tilepd.model_format.model_spec import spec_from_hf_config

    device = torch.device(DEVICE)
    built: dict[str, tuple] = {}
    refs: dict[tuple[str, int], list[int]] = {}

    def get(name: str, context: int) -> tuple:
        if name not in built:
            spec = spec_from_hf_config(MODELS[name])
            built[name] = (spec, random_runtime_weights(spec, device, torch.float32))
        spec, weights = built[name]
        if (name, context) not in refs:
            refs[name, context] = _decode(spec, weights, device, "graph", context, TOKENS)[0]
        return spec, weights, refs[name, context]

    return get


@pytest.mark.parametrize("name,context,variant", CASES)
def test_speed_path_decodes_the_reference_tokens(name: str, context: int, variant: str, reference: Callable[[str, int], tuple]) -> None:
    spec, weights, want = reference(name, context)
    got, note = _decode(spec, weights, torch.device(DEVICE), variant, context, TOKENS, want if variant.endswith("oracle") else None)
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    assert "capture_error" not in note, note
    assert got == want, f"{name} ctx={context} {variant}: first differing token {first} of {len(got)} ({note})"
