"""tilepd.model_format: what a model is, below both the engine and the weights converter.

`model_spec`: ModelSpec and spec_from_hf_config (torch-free: the topology validator and `convert-weights`'s
skip path read it); `block_fp8`: the block-scaled fp8 weight format (needs torch). Imports nothing of tilepd,
so `weights/` and `topology/` use the model's format without importing the engine.
"""
