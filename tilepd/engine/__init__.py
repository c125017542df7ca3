"""tilepd's batch-1 decode engine (INTERFACES §1): load_engine, KVState, SamplingParams, DecodeResult.

Names are resolved lazily so that torch-free users (the CLI's skip path, config readers) can import
`tilepd.engine.spec` without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CAPABILITIES": "tilepd.engine.engine", "Engine": "tilepd.engine.engine", "load_engine": "tilepd.engine.engine",
    "ModelSpec": "tilepd.engine.spec", "spec_from_hf_config": "tilepd.engine.spec", "spec_from_model_dir": "tilepd.engine.spec",
    "UnsupportedModelError": "tilepd.engine.spec",
    "TPEngine": "tilepd.engine.tp_engine", "launch_tp_engine": "tilepd.engine.tp_engine",
    "DecodeResult": "tilepd.engine.types", "KVState": "tilepd.engine.types", "SamplingParams": "tilepd.engine.types",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tilepd.engine' has no attribute {name!r}")
