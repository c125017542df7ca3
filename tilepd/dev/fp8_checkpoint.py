"""Write a block-scaled fp8 copy of an HF checkpoint, shaped like DeepSeek-V3's / GLM-5's fp8 releases.

The real checkpoints store every linear projection of attention and the MLPs (dense, routed and shared
experts; DSA indexer wq_b and wk) as float8_e4m3fn with a float32 `<name>_scale_inv` of one scale per
128x128 block, and set config.json `quantization_config = {quant_method: fp8, fmt: e4m3,
activation_scheme: dynamic, weight_block_size: [128, 128]}`. Embeddings, lm_head, norms, the router gate
(and its bias), MTP eh_proj and the indexer's weights_proj stay dense. Tests use this to exercise the
fp8 source path (kept as it is) on tiny models.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tilepd.weights.errors import WeightsError

# Linear projections that carry a weight_scale_inv in DeepSeek-V3 / V3.2 / GLM-5 fp8 checkpoints.
QUANTISED = re.compile(
    r"\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.(gate_proj|up_proj|down_proj)|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj))\.weight$"
)


def is_quantised(name: str) -> bool:
    """Whether a real fp8 release stores tensor `name` in fp8 with block scales."""
    return QUANTISED.search(name) is not None


def write_fp8_checkpoint(src: Path, out: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Copy HF checkpoint `src` to `out` with its linear projections quantised to e4m3 + block scales."""
    import torch
    from safetensors.torch import save_file

    from tilepd.model_format.block_fp8 import quantize
    from tilepd.weights.source import Checkpoint

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    with Checkpoint(src) as ck:
        cfg = ck.config()
        if "quantization_config" in cfg:
            raise WeightsError(f"{src / 'config.json'}: already quantised ({cfg['quantization_config'].get('quant_method')!r})")
        for name in sorted(ck.names()):
            t = ck.get(name)
            if is_quantised(name) and t.dim() == 2:
                q = quantize(t, block)
                tensors[name] = q.weight
                tensors[name + "_scale_inv"] = q.scale
            else:
                tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, out / f.name)
    return out
