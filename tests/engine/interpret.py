"""Running engine code under Triton's CPU interpreter in a child process (TRITON_INTERPRET is read at import time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def interpret(argv: list[str], repo_root: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python *argv` with TRITON_INTERPRET=1, this checkout first on the path and one OpenMP thread (the kernels' CPU
    tests run on a shared 2-core box)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout)
