"""tilepd.weights: HF checkpoint -> tilepd runtime weights (convert-weights): the tensors, their fp8 blocks, the manifest.

Lazy exports: the manifest check behind a skipped re-run must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"ConvertResult": "tilepd.weights.convert", "convert_weights": "tilepd.weights.convert",
            "WeightsError": "tilepd.weights.source"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tilepd.weights' has no attribute {name!r}")
