"""The MoE router gate as the checkpoints store it (bf16) gives the same float32 logits, expert ids and weights as the
same values in float32: the torch router and moe(), the Triton gate kernel and the fused MoE block (Triton's CPU
interpreter), and a whole bf16 release of the tiny GLM-5 model, which decodes HF's greedy tokens with its gate in bf16.

HF computes the router logits as F.linear(h.float(), weight.float()), and bf16 -> float32 is exact, so a bf16 gate
upcast where it is used is bit-identical to a float32 copy of it, from half the bytes."""

from __future__ import annotations

import importlib.util
import json
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.conftest import DSA_STEPS, dsa_prompt, one_torch_thread
from tests.engine.interpret import interpret
from tilepd.dev.hf_reference import Reference, hf_reference
from tilepd.engine import SamplingParams, load_engine, moe

GREEDY = SamplingParams(ignore_eos=True)


def _moe_weights(ne: int, hid: int, mi: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    """One MoE layer under prefix "l.", its router gate bf16 (random values rounded, as a checkpoint holds them)."""
    w = {"l.mlp_norm": (1 + 0.1 * torch.randn(hid, generator=g)).to(dtype),
         "l.gate": (torch.randn(ne, hid, generator=g) * hid ** -0.5).to(torch.bfloat16), "l.gate_bias": torch.randn(ne, generator=g) * 0.1}
    for name, shape in (("experts_w13", (ne, 2 * mi, hid)), ("experts_w2", (ne, hid, mi)), ("shared_w13", (2 * mi, hid)), ("shared_w2", (hid, mi))):
        w["l." + name] = (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype)
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("ne", "ng", "tg", "k"), [(16, 4, 2, 3), (16, 1, 1, 4)])  # DeepSeek-V3's groups, GLM-5's one group
def test_torch_router_and_moe_are_the_same_with_a_bf16_gate(dtype: torch.dtype, ne: int, ng: int, tg: int, k: int) -> None:
    g = torch.Generator().manual_seed(ne * 10 + ng)
    spec = SimpleNamespace(n_group=ng, topk_group=tg, num_experts_per_tok=k, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6)
    w = _moe_weights(ne, 32, 16, dtype, g)
    wide = {**w, "l.gate": w["l.gate"].float()}
    for t in (1, 4):
        x = (torch.randn(t, 32, generator=g) * 2).to(dtype)
        ids, weights = moe.route_torch(x, w["l.gate"], w["l.gate_bias"], spec)
        want_ids, want_weights = moe.route_torch(x, wide["l.gate"], wide["l.gate_bias"], spec)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights) and weights.dtype == torch.float32
        assert torch.equal(moe.moe(x, w, "l.", spec), moe.moe(x, wide, "l.", spec))
        assert torch.equal(moe.mlp_block(x, w, "l.", spec, True), moe.mlp_block(x, wide, "l.", spec, True))


_KERNELS = textwrap.dedent("""
    import torch
    from types import SimpleNamespace
    from tilepd.engine import layers, moe, moe_fused, moe_fused_triton as K
    g = torch.Generator().manual_seed(0)
    K.TUNE.update(gate_block_e=32, up_block_n=8, up_block_k=16, down_block_n=8, down_block_k=16, up_few=0)
    moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"], moe.BLOCK_IMPL["moe"] = "triton", "triton", "triton"
    checked = 0
    for chunk in (16, 64):  # the row (hidden 40) in three K chunks, and in one (the served shapes' path)
        K.TUNE["gate_block_k"] = chunk
        for dtype in (torch.float32, torch.bfloat16):
            for ne, ng, tg, k in ((32, 4, 2, 3), (32, 1, 1, 4)):
                spec = SimpleNamespace(n_group=ng, topk_group=tg, num_experts_per_tok=k, norm_topk_prob=True, routed_scaling_factor=2.5,
                                       rms_norm_eps=1e-6)
                hid, mi = 40, 24
                w = {"l.mlp_norm": (1 + 0.1 * torch.randn(hid, generator=g)).to(dtype),
                     "l.gate": (torch.randn(ne, hid, generator=g) * hid ** -0.5).to(torch.bfloat16), "l.gate_bias": torch.randn(ne, generator=g) * 0.1}
                for name, shape in (("experts_w13", (ne, 2 * mi, hid)), ("experts_w2", (ne, hid, mi)), ("shared_w13", (2 * mi, hid)),
                                    ("shared_w2", (hid, mi))):
                    w["l." + name] = (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype)
                wide = {**w, "l.gate": w["l.gate"].float()}
                for t in (1, 4):
                    x = (torch.randn(t, hid, generator=g) * 2).to(dtype)
                    # the gate kernel: normed row, ids, weights and float32 logits bit for bit, routed apart and in its last program
                    for apart in (0, 1):
                        K.TUNE["route_apart"] = apart
                        got = K.gate_route(x, w["l.mlp_norm"], 1e-6, w["l.gate"], w["l.gate_bias"], ng, tg, k, True, 2.5)
                        want = K.gate_route(x, w["l.mlp_norm"], 1e-6, wide["l.gate"], wide["l.gate_bias"], ng, tg, k, True, 2.5)
                        assert all(torch.equal(a, b) for a, b in zip(got, want)), (chunk, dtype, ng, t, apart)
                        assert got[3].dtype == torch.float32
                    K.TUNE["route_apart"] = 1
                    # the router kernel after the gate GEMV (moe.route), and the grouped MoE it feeds
                    h = layers.rms_norm(x, w["l.mlp_norm"], 1e-6)
                    ids, weights = moe.route(h, w["l.gate"], w["l.gate_bias"], spec)
                    want_ids, want_weights = moe.route(h, wide["l.gate"], wide["l.gate_bias"], spec)
                    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights), (chunk, dtype, ng, t)
                    ref_ids, _ = moe.route_torch(h, wide["l.gate"], wide["l.gate_bias"], spec)
                    assert torch.equal(ids.sort(-1)[0], ref_ids.sort(-1)[0]), (chunk, dtype, ng, t)
                    assert torch.equal(moe.moe_grouped(h, w, "l.", spec), moe.moe_grouped(h, wide, "l.", spec))
                    # the fused block takes the bf16 gate as it is and gives the float32 copy's bits
                    assert moe_fused.applies(x, w, "l.", spec) and moe.use_fused_block(x, w, "l.", spec), (dtype, t)
                    got = moe_fused.moe_block(x, w, "l.", spec)
                    assert torch.equal(got, moe_fused.moe_block(x, wide, "l.", spec)), (chunk, dtype, ng, t)
                    assert torch.equal(moe.mlp_block(x, w, "l.", spec, True), got)
                    checked += 1
                # a gate it cannot read as it is: an fp16 one, a non-contiguous one -> the unfused ops, which upcast it
                x = torch.randn(1, 40, generator=g).to(dtype)
                assert not moe_fused.applies(x, {**w, "l.gate": w["l.gate"].half()}, "l.", spec)
                strided = torch.empty(ne, 2 * 40, dtype=torch.bfloat16)[:, ::2]
                strided.copy_(w["l.gate"])
                assert not strided.is_contiguous() and not moe_fused.applies(x, {**w, "l.gate": strided}, "l.", spec)
                moe.BLOCK_IMPL["moe"] = "torch"
                unfused = moe.mlp_block(x, w, "l.", spec, True)
                moe.BLOCK_IMPL["moe"] = "triton"
                assert torch.equal(moe.mlp_block(x, {**w, "l.gate": strided}, "l.", spec, True), unfused)
    print(f"gate dtype ok {checked}")
""")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")
def test_gate_kernel_and_fused_block_are_the_same_with_a_bf16_gate_under_interpreter(repo_root: Path) -> None:
    r = interpret(["-c", _KERNELS], repo_root, timeout=900)
    assert r.returncode == 0 and "gate dtype ok 16" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


# --- a bf16 release of the tiny GLM-5 model: HF's tokens with the gate bf16 in the engine --------------------------


@pytest.fixture(scope="module")
def glm5_bf16(tiny_glm5: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_glm5 stored as a bf16 release: every float tensor bf16 (values rounded), config.json dtype bfloat16."""
    out = tmp_path_factory.mktemp("glm5-bf16") / "hf"
    out.mkdir()
    tensors = load_file(str(tiny_glm5 / "model.safetensors"))
    save_file({n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for f in tiny_glm5.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


@pytest.fixture(scope="module")
def glm5_bf16_ref(glm5_bf16: Path) -> Reference:
    with one_torch_thread():
        return hf_reference(glm5_bf16, "glm5", DSA_STEPS, prompt_ids=dsa_prompt("short"))  # HF in float32 (exact bf16 values)


@pytest.fixture(scope="module")
def glm5_bf16_converted(glm5_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tilepd.weights import convert_weights

    out = tmp_path_factory.mktemp("glm5-bf16-w") / "w"
    convert_weights(glm5_bf16, out, dtype="bf16", progress=False)
    return out


def _decode(path: Path, ref: Reference) -> tuple[list[int], list[torch.Tensor], dict]:
    eng = load_engine(path, device="cpu", max_seq_len=256, dtype="float32", num_speculative_tokens=0)
    eng.eager_step.logits_log = []
    eng.inject(ref.state)
    res = eng.decode(ref.tokens[0], DSA_STEPS, GREEDY, lambda t: None)
    return res.tokens, eng.eager_step.logits_log, eng.model.w


def test_bf16_release_decodes_hfs_tokens_with_its_gate_in_bf16(glm5_bf16: Path, glm5_bf16_converted: Path, glm5_bf16_ref: Reference) -> None:
    tokens, logits, w = _decode(glm5_bf16_converted, glm5_bf16_ref)
    gates = [n for n in w if n.endswith(".gate")]
    assert gates and all(w[n].dtype == torch.bfloat16 for n in gates), {n: w[n].dtype for n in gates}  # kept as stored
    assert w["layers.1.wo"].dtype == torch.float32  # the float32 engine upcasts the rest (exactly: bf16 values)
    assert tokens == glm5_bf16_ref.tokens[1:]
    diff = max(float((a - b).abs().max()) for a, b in zip(logits, glm5_bf16_ref.logits[1:]))
    assert diff < 1e-4, diff
    assert len(set(glm5_bf16_ref.tokens)) >= 8  # a degenerate reference would prove little
    # the same checkpoint converted in memory for a float32 engine holds the gate float32: the very same logits
    wide_tokens, wide_logits, wide = _decode(glm5_bf16, glm5_bf16_ref)
    assert all(wide[n].dtype == torch.float32 and torch.equal(wide[n], w[n].float()) for n in gates)
    assert wide_tokens == tokens and all(torch.equal(a, b) for a, b in zip(wide_logits, logits))


_ENGINE = textwrap.dedent("""
    import sys
    import torch
    from tilepd.engine import KVState, SamplingParams, gemv_triton, layers, load_engine, mla_fused, moe, moe_fused, moe_fused_triton, moe_triton
    torch.set_num_threads(1)
    gemv_triton.TUNE["block_n"], moe_triton.TUNE["block_n"] = 256, 64  # few programs a launch: the interpreter pays per program
    moe_fused_triton.TUNE.update(gate_block_e=16, up_block_n=64, down_block_n=64, up_few=0)
    blocks = {"bf16": 0}
    real = moe_fused.moe_block
    def counted(x, w, p, spec, residual=True):  # a spy, not a stand-in: counts the fused block ran with the bf16 gate
        blocks["bf16"] += w[p + "gate"].dtype == torch.bfloat16
        return real(x, w, p, spec, residual)
    moe_fused.moe_block = counted
    layers.ATTENTION_IMPL["mla"] = mla_fused.FUSED_IMPL["attention"] = "triton"
    moe.EXPERT_IMPL["dense"] = moe.ROUTE_IMPL["router"] = moe.BLOCK_IMPL["moe"] = "triton"
    path, ref = sys.argv[1], torch.load(sys.argv[2])
    eng = load_engine(path, device="cpu", max_seq_len=256, dtype="float32", num_speculative_tokens=0)
    mla_fused.prepare_model(eng.model)
    eng.inject(KVState(ref["seq_len"], ref["layers"], ref["indexer"]))
    got = eng.decode(ref["tokens"][0], len(ref["tokens"]) - 1, SamplingParams(ignore_eos=True), lambda t: None).tokens
    assert blocks["bf16"] > 0, "the fused MoE block did not run with the bf16 gate"
    assert got == ref["tokens"][1:], (got, ref["tokens"][1:])
    print("engine ok", blocks)
""")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")
def test_bf16_release_decodes_hfs_tokens_through_the_fused_moe_block(glm5_bf16_converted: Path, glm5_bf16_ref: Reference, repo_root: Path,
                                                                      tmp_path: Path) -> None:
    ref = glm5_bf16_ref
    torch.save({"seq_len": ref.state.seq_len, "layers": ref.state.layers, "indexer": ref.state.indexer, "tokens": ref.tokens[:9]},
               tmp_path / "ref.pt")
    r = interpret(["-c", _ENGINE, str(glm5_bf16_converted), str(tmp_path / "ref.pt")], repo_root, timeout=900)
    assert r.returncode == 0 and "engine ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]

