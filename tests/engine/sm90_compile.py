"""Compile the engine's Triton kernels for sm_90 on a machine without a GPU (test helper).

`compiling()` replaces Triton's launch with a compile for GPUTarget("cuda", 90, 32) (Triton's own ptxas, no driver):
each kernel the code under test would launch is compiled with the launch's arguments and options, and what it
compiled is recorded (name, options, the PTX), nothing runs. So a CPU test can check that a kernel's sm_90 form
(PDL's griddepcontrol, inline PTX) compiles, which the interpreter never does."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32",
           torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "num_ctas")


def _signature(fn: object, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    params = inspect.signature(fn.fn).parameters
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    bound = inspect.signature(fn.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    sig, consts = {}, {}
    for name, value in bound.arguments.items():
        if params[name].annotation is not inspect.Parameter.empty and "constexpr" in str(params[name].annotation):
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _DTYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"sm90_compile: argument {name} of {fn.fn.__name__}: {type(value).__name__}")
    return sig, consts, options


@contextlib.contextmanager
def compiling() -> Iterator[list[dict]]:
    """Within: every Triton launch compiles for sm_90 instead of running; yields the list of what was compiled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    done: list[dict] = []
    real = JITFunction.run

    def run(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
        sig, consts, options = _signature(self, args, dict(kwargs))
        compiled = triton.compile(ASTSource(fn=self, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=options)
        done.append({"name": self.fn.__name__, "options": options, "ptx": compiled.asm["ptx"], "constexprs": consts})

    JITFunction.run = run
    try:
        yield done
    finally:
        JITFunction.run = real
