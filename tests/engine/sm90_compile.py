"""Compile the engine's Triton kernels for sm_90 on a machine without a GPU (test helper).

`compiling()` replaces Triton's launch with a compile for GPUTarget("cuda", 90, 32) (Triton's own ptxas, no driver):
each kernel the code under test would launch is compiled with the launch's arguments and options, and what it
compiled is recorded (name, options, the PTX), nothing runs. So a CPU test can check that a kernel's sm_90 form
(PDL's griddepcontrol, inline PTX) compiles, which the interpreter never does."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "num_ctas")


@contextlib.contextmanager
def compiling() -> Iterator[list[dict]]:
    """Within: every Triton launch compiles for sm_90 instead of running; yields the list of what was compiled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    done: list[dict] = []
    real = JITFunction.run
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)

    def run(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
        # the launcher's own specialization (16-byte divisibility of pointers and ints, ints of 1 as constants), so
        # the PTX is the one a device launch would build (vector loads included)
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
        consts = {name: bound[name] for name, kind in signature.items() if kind == "constexpr"}
        done.append({"name": self.fn.__name__, "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}, "ptx": compiled.asm["ptx"],
                     "constexprs": consts})

    JITFunction.run = run
    try:
        yield done
    finally:
        JITFunction.run = real


def ptxas_info(ptx: str) -> dict[str, int]:
    """What ptxas reports for a kernel's sm_90a build (registers a thread, spill stores and loads in bytes): the static
    figures a CPU box can give about a kernel's occupancy and register pressure."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, timeout=300, check=True)
    log = res.stderr + res.stdout
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"ptxas -v gave no register line: {log[-500:]}")
    return {"registers": int(regs.group(1)), "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2))}
