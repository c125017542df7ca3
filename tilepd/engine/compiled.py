"""The engine's CUDA speed path: which kernels a model's decode step uses, with fallbacks.

`accelerate(model)` switches a freshly built model to the fastest path measured on an H200
(bench/decode_speed.py, docs/PERFORMANCE.md): attention through the split-KV Triton kernel
(attention.py), Llama-family GEMVs with the norms, SiLU-mul and residual adds fused in (gemv_triton.py),
DeepSeek-family latent attention (dense and DSA) through the MLA kernel (mla_attention.py),
routed experts with dense weights through the grouped GEMV that reads them in place (moe_triton.py), the MoE
router after its gate GEMV as one kernel (route_triton.py; with the expert GEMV also on, the shared expert runs as one
more row of the routed experts' launches, moe.moe_grouped; with both on, a MoE layer's norm, MoE and residual add run as
4 launches, moe_fused.py), and the per-layer element-wise work fused by torch.compile, with the cache-reading
attention left outside the compiled code (so one compilation serves every cache-window bucket and the
cache is never copied). Compilation and Triton builds only happen at the first graph capture; if that
fails, GraphStep applies the returned fallbacks one at a time (first drop torch.compile, then the
Triton attention) and captures again, so a request never fails over a speed path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from tilepd.engine import layers, moe

log = logging.getLogger(__name__)

_SWAPPED = ("attn_in", "attn_out_mlp", "post_attn")

# Inductor options of the speed path's torch.compile: coordinate descent over the launch configs of the fused
# element-wise and reduction kernels. With the fused dense GEMV (Llama) they are only RoPE's; without it Inductor also
# lowers the batch-1 GEMVs into its own reductions, and its picks moved the Llama-3-8B step by ~8% between compilations
# (docs/PERFORMANCE.md). A `compile_mode` given to accelerate() replaces these.
SPEED_COMPILE_OPTIONS: dict[str, object] = {"coordinate_descent_tuning": True}


@dataclass
class SpeedPath:
    """What `accelerate` turned on (`parts`, for logs and the bench) and how to undo it, in the order GraphStep tries."""

    parts: list[str] = field(default_factory=list)
    fallbacks: list[Callable[[], str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "+".join(self.parts) or "plain"


def reference_path() -> None:
    """Every speed-path switch back to the portable ops: the tables are module state, shared by a bench's variants and
    by tests that build several engines in one process."""
    from tilepd.engine import mla_fused

    layers.ATTENTION_IMPL.update(default="sdpa", mla="reference")
    layers.GEMV_IMPL["dense"] = "torch"
    moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"], moe.BLOCK_IMPL["moe"] = "gather", "torch", "torch"
    mla_fused.FUSED_IMPL["attention"] = "torch"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken Triton install fails its import in many ways: no kernels then
        return False
    return True


def _switch_on(path: SpeedPath, table: dict[str, str], key: str, part: str, what: str, *, first: bool = False) -> None:
    """Point `table[key]` at the Triton implementation, name it in `path` (`first`: at the front of the name) and put
    its undo first among the fallbacks."""
    before = table[key]
    table[key] = "triton"
    if first:
        path.parts.insert(0, part)
    else:
        path.parts.append(part)

    def undo() -> str:
        table[key] = before
        return f"{what} back to {before}"

    path.fallbacks.insert(0, undo)


def accelerate(model, *, compile_layers: bool = True, triton_attention: bool = True, mla_attention: bool = True,
               moe_gemv: bool = True, moe_route: bool = True, moe_fused: bool = True, fused_gemv: bool = True,
               mla_fused: bool = True,
               compile_mode: str | None = None) -> SpeedPath:
    """Turn on the speed path for `model` (CUDA only; call before the first graph capture); `compile_mode` None compiles
    with SPEED_COMPILE_OPTIONS."""
    path = SpeedPath()
    spec = getattr(model, "spec", None)
    family, experts = getattr(spec, "family", None), getattr(spec, "n_routed_experts", 0)
    triton = _triton_available()
    # each switch's undo goes to the front: the last one turned on is the first one GraphStep takes back
    if triton_attention and triton:
        _switch_on(path, layers.ATTENTION_IMPL, "default", "triton-attn", "attention")
    if mla_attention and triton and family == "deepseek_v3":
        _switch_on(path, layers.ATTENTION_IMPL, "mla", "mla-kernel", "MLA attention")  # undone before the generic one
    from tilepd.engine import mla_fused as fused_attention

    fused_attention.FUSED_IMPL["attention"] = "torch"  # off unless this call turns it on (a bench's variants share the table)
    if mla_fused and mla_attention and triton and family == "deepseek_v3" and hasattr(model, "fused"):
        fused_attention.prepare_model(model)  # concatenated projections, before any capture
        _switch_on(path, fused_attention.FUSED_IMPL, "attention", "mla-fused", "fused MLA attention")  # undone before the MLA kernel
    if moe_gemv and triton and experts:
        _switch_on(path, moe.EXPERT_IMPL, "dense", "moe-gemv", "routed experts")
    if moe_route and triton and experts:
        _switch_on(path, moe.ROUTE_IMPL, "router", "moe-route", "MoE router")
    if moe_fused and moe_gemv and moe_route and triton and experts:  # the fused block stands on both; undone before them
        _switch_on(path, moe.BLOCK_IMPL, "moe", "moe-fused", "fused MoE block")
    if fused_gemv and triton and family == "llama":
        _switch_on(path, layers.GEMV_IMPL, "dense", "fused-gemv", "dense GEMVs", first=True)  # undone before the attention kernel
    if compile_layers and hasattr(model, "compile"):
        saved = {name: getattr(model, name) for name in _SWAPPED if hasattr(model, name)}
        try:
            if compile_mode is None:
                model.compile(options=dict(SPEED_COMPILE_OPTIONS), include_attention=False)
            else:
                model.compile(mode=compile_mode, include_attention=False)
        except Exception as e:  # noqa: BLE001 - compile() itself only wraps functions; real failures come at capture
            log.warning("event=torch_compile_unavailable error=%s", e)
        else:
            path.parts.insert(0, "compile(no-attn)")

            def undo_compile() -> str:
                for name, fn in saved.items():
                    setattr(model, name, fn)
                return "torch.compile dropped"

            path.fallbacks.insert(0, undo_compile)
    path.parts.append("graph")
    return path
