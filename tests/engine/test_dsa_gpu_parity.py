"""GPU parity (marker gpu): DSA (sparse attention) on the GPU speed path decodes HF transformers' greedy tokens
(tiny glm5 / dsv32).

For each tiny DSA model and a prompt shorter than index_topk (10 tokens) and one 5x longer (80 tokens), the
engine on CUDA (captured graphs per cache window, compiled.accelerate speed path, float32 so the comparison is
exact) is injected with HF's prefill state (MLA latent + indexer keys) and must decode HF's greedy
continuation, through the graph step and through the MTP step. The tiny models and HF's references are made
on the CPU first (transformers), once per module.

    pytest -m gpu tests/engine/test_dsa_gpu_parity.py
        # was `python bench/dsa_gpu_parity.py --prepare DIR` on CPU, then `--check DIR` on the GPU
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

MODELS = ("glm5", "dsv32")
PROMPTS = {"short": 10, "long": 80}
STEPS = 32
DEVICE = "cuda"  # where the checks run (a dry run of this file's own logic can set cpu: the graphs' static body, eagerly)


REFS_ENV = "TILEPD_DSA_GPU_REFS"  # a folder `prepare_references` wrote (on a CPU box with the project's transformers)


def prepare_references(out: Path) -> Path:
    """Tiny models and HF's prefill state + greedy tokens for each prompt, made on the CPU (needs transformers).

    HF's cache layout is the reference's input, and the project's transformers (5.19) stores the MLA latent there;
    with the GPU machine's own transformers (5.17) the reference's layer 0 came back [80, 4, 128] instead of
    [80, 1, 576] (2026-12-03), so the references are made where the project's environment is and carried
    (`REFS_ENV`), as the GPU bench did before it became this test:
        python -c "from pathlib import Path; from tests.engine.test_dsa_gpu_parity import prepare_references as p; p(Path('build/dsa-gpu-refs'))"
    """
    from tilepd.dev.hf_reference import hf_reference
    from tilepd.dev.tiny_model import make_tiny_model

    out.mkdir(parents=True, exist_ok=True)
    for model in MODELS:
        path = make_tiny_model(model, out / model)
        for kind, n in PROMPTS.items():
            ids = torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(1)).tolist()
            ref = hf_reference(path, model, STEPS, prompt_ids=ids)
            torch.save({"seq_len": ref.state.seq_len, "layers": ref.state.layers, "indexer": ref.state.indexer,
                        "tokens": ref.tokens}, out / f"{model}-{kind}.pt")
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The references `REFS_ENV` names, else made here (needs transformers)."""
    carried = os.environ.get(REFS_ENV)
    if carried:
        path = Path(carried)
        missing = [f"{m}-{k}.pt" for m in MODELS for k in PROMPTS if not (path / f"{m}-{k}.pt").is_file()]
        if missing:
            raise FileNotFoundError(f"{REFS_ENV}={carried}: {', '.join(missing)} missing (prepare_references writes them)")
        return path
    pytest.importorskip("transformers", reason="the tiny models and HF references need transformers")
    return prepare_references(tmp_path_factory.mktemp("dsa-refs"))


@pytest.fixture(scope="module")
def engines(references: Path) -> dict:
    """Per model: the graph-step engine (windows below, at and above index_topk, captured) and the MTP engine."""
    from tilepd.engine import load_engine

    out = {}
    for model in MODELS:
        graph = load_engine(references / model, device=DEVICE, max_seq_len=256, dtype="float32", use_cuda_graph=True,
                            num_speculative_tokens=0)
        graph.graph_step.buckets = [16, 32, 64, 128, 256]
        graph.warmup()
        out[model] = {"graph": graph, "mtp-speculative": load_engine(references / model, device=DEVICE, max_seq_len=256, dtype="float32")}
    return out


@pytest.mark.parametrize("path", ["graph", "mtp-speculative"])
@pytest.mark.parametrize("kind", list(PROMPTS))
@pytest.mark.parametrize("model", MODELS)
def test_dsa_speed_path_decodes_hf_greedy_tokens(model: str, kind: str, path: str, references: Path, engines: dict) -> None:
    from tilepd.engine import KVState, SamplingParams

    ref = torch.load(references / f"{model}-{kind}.pt")
    eng = engines[model][path]
    f32 = torch.float32
    eng.inject(KVState(ref["seq_len"], [x.to(f32) for x in ref["layers"]], [None if x is None else x.to(f32) for x in ref["indexer"]]))
    got = eng.decode(ref["tokens"][0], STEPS, SamplingParams(ignore_eos=True), lambda t: None).tokens
    want = ref["tokens"][1:]
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    assert got == want, f"{model} {kind} {path} speed_path={eng.speed_path}: first {same} of {len(want)} tokens equal (engine {got[:10]} vs HF {want[:10]})"
