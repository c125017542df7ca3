"""tilepd's batch-1 decode engine (INTERFACES §1): load_engine, KVState, SamplingParams, DecodeResult."""

from tilepd.engine.engine import CAPABILITIES, Engine, load_engine
from tilepd.engine.spec import ModelSpec, spec_from_hf_config, spec_from_model_dir
from tilepd.engine.types import DecodeResult, KVState, SamplingParams

__all__ = [
    "CAPABILITIES", "DecodeResult", "Engine", "KVState", "ModelSpec", "SamplingParams", "load_engine",
    "spec_from_hf_config", "spec_from_model_dir",
]
