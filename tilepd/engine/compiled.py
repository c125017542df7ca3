"""The engine's CUDA speed path: which kernels a model's decode step uses, with fallbacks.

`accelerate(model)` switches a freshly built model to the fastest path measured on an H200
(bench/decode_speed.py, docs/PERFORMANCE.md): attention through the split-KV Triton kernel
(attention.py), Llama-family GEMVs with the norms, SiLU-mul and residual adds fused in (gemv_triton.py),
DeepSeek-family latent attention (dense and DSA) through the MLA kernel (mla_attention.py),
routed experts with dense weights through the grouped GEMV that reads them in place (moe_triton.py), the MoE
router after its gate GEMV as one kernel (route_triton.py; with the expert GEMV also on, the shared expert runs as one
more row of the routed experts' launches, moe.moe_grouped), and the per-layer element-wise work fused by torch.compile, with the cache-reading
attention left outside the compiled code (so one compilation serves every cache-window bucket and the
cache is never copied). Compilation and Triton builds only happen at the first graph capture; if that
fails, GraphStep applies the returned fallbacks one at a time (first drop torch.compile, then the
Triton attention) and captures again, so a request never fails over a speed path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from tilepd.engine import layers

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


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken Triton install fails its import in many ways: no kernels then
        return False
    return True


def accelerate(model, *, compile_layers: bool = True, triton_attention: bool = True, mla_attention: bool = True,
               moe_gemv: bool = True, moe_route: bool = True, fused_gemv: bool = True, compile_mode: str | None = None) -> SpeedPath:
    """Turn on the speed path for `model` (CUDA only; call before the first graph capture); `compile_mode` None compiles
    with SPEED_COMPILE_OPTIONS."""
    path = SpeedPath()
    if triton_attention and _triton_available():
        before = layers.ATTENTION_IMPL["default"]
        layers.ATTENTION_IMPL["default"] = "triton"
        path.parts.append("triton-attn")

        def undo_triton() -> str:
            layers.ATTENTION_IMPL["default"] = before
            return f"attention back to {before}"

        path.fallbacks.insert(0, undo_triton)
    if mla_attention and _triton_available() and getattr(getattr(model, "spec", None), "family", None) == "deepseek_v3":
        before_mla = layers.ATTENTION_IMPL["mla"]
        layers.ATTENTION_IMPL["mla"] = "triton"
        path.parts.append("mla-kernel")

        def undo_mla() -> str:
            layers.ATTENTION_IMPL["mla"] = before_mla
            return f"MLA attention back to {before_mla}"

        path.fallbacks.insert(0, undo_mla)  # a failing MLA kernel is undone before the generic one
    if moe_gemv and _triton_available() and getattr(getattr(model, "spec", None), "n_routed_experts", 0):
        from tilepd.engine import moe

        before_moe = moe.EXPERT_IMPL["dense"]
        moe.EXPERT_IMPL["dense"] = "triton"
        path.parts.append("moe-gemv")

        def undo_moe() -> str:
            moe.EXPERT_IMPL["dense"] = before_moe
            return f"routed experts back to {before_moe}"

        path.fallbacks.insert(0, undo_moe)
    if moe_route and _triton_available() and getattr(getattr(model, "spec", None), "n_routed_experts", 0):
        from tilepd.engine import moe

        before_route = moe.ROUTE_IMPL["router"]
        moe.ROUTE_IMPL["router"] = "triton"
        path.parts.append("moe-route")

        def undo_route() -> str:
            moe.ROUTE_IMPL["router"] = before_route
            return f"MoE router back to {before_route}"

        path.fallbacks.insert(0, undo_route)
    if fused_gemv and _triton_available() and getattr(getattr(model, "spec", None), "family", None) == "llama":
        before_gemv = layers.GEMV_IMPL["dense"]
        layers.GEMV_IMPL["dense"] = "triton"
        path.parts.insert(0, "fused-gemv")

        def undo_gemv() -> str:
            layers.GEMV_IMPL["dense"] = before_gemv
            return f"dense GEMVs back to {before_gemv}"

        path.fallbacks.insert(0, undo_gemv)  # a failing fused GEMV is undone before the generic attention kernel
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
