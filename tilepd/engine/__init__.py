"""tilepd's batch-1 decode engine (INTERFACES §1): load_engine, KVState, SamplingParams, DecodeResult.

Names are resolved lazily: importing the package loads no torch until a name is used. The model's shapes
(`ModelSpec`, `spec_from_hf_config`) are not the engine's: they live in `tilepd.model_format.model_spec`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CAPABILITIES": "tilepd.engine.engine", "Engine": "tilepd.engine.engine", "load_engine": "tilepd.engine.engine",
    "TPEngine": "tilepd.engine.tp_engine", "launch_tp_engine": "tilepd.engine.tp_engine",
    "DecodeResult": "tilepd.engine.types", "KVState": "tilepd.engine.types", "SamplingParams": "tilepd.engine.types",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tilepd.engine' has no attribute {name!r}")
