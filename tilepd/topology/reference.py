"""docs/TOPOLOGY.md, generated from the schema, the rules and the exit codes.

`python -m tilepd.topology.reference --write docs/TOPOLOGY.md` regenerates it; a test
fails when the file and this output differ, so the reference cannot drift.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from tilepd.contracts.exit_codes import EXIT_CODE_MEANINGS, ExitCode
from tilepd.topology.families import ALIASES, RUNTIME_FAMILIES
from tilepd.topology.rules import rule_docs
from tilepd.topology.schema import API_VERSION, Topology

SCHEMA_RULES = {
    "schema.unknown-key": "A key the schema does not know (with a 'did you mean' when one is close).",
    "schema.missing": "A required key is absent (points at the mapping that lacks it).",
    "schema.invalid": "A value of the wrong type, out of range, or not one of the allowed words.",
}


def _anchor(cls: type[BaseModel]) -> str:
    return cls.__name__.lower()


def _type_text(ann: Any) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        parts = [_type_text(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return text + " or null" if type(None) in args else text
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (list, tuple):
        return f"list of {_type_text(args[0])}"
    if origin is dict:
        return f"map of {_type_text(args[0])} to {_type_text(args[1])}"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return f"[{ann.__name__}](#{_anchor(ann)})"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(ann, str(ann))


def _default_text(field: Any) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(all defaults)"
        return f"`{value!r}`".replace("'", "")
    if field.default is None or field.default is PydanticUndefined:
        return "none"
    value = field.default
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _models_in_order() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []

    def visit(ann: Any) -> None:
        args = typing.get_args(ann)
        if args:
            for arg in args:
                visit(arg)
        elif isinstance(ann, type) and issubclass(ann, BaseModel) and ann not in seen:
            seen.append(ann)
            for f in ann.model_fields.values():
                visit(f.annotation)

    visit(Topology)
    return seen


def _constraints(field: Any) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "min length")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sym} {value}")
        if getattr(meta, "pattern", None):
            parts.append(f"pattern `{meta.pattern}`")
    return f" ({', '.join(parts)})" if parts else ""


def _memory_section() -> list[str]:
    """Rule memory-fit: what it counts, the GPU table and the bundled model figures (from the modules themselves)."""
    from tilepd.topology.gpus import GIB, known_gpu
    from tilepd.topology.gpus import _TYPES as GPU_TYPES
    from tilepd.topology.known_models import KNOWN_MODELS
    from tilepd.topology.memory_fit import VLLM_ACTIVATION_BYTES, VLLM_DEFAULT_UTILIZATION, WORKSPACE_BYTES

    out = [
        "## GPU memory (rule `memory-fit`)",
        "",
        "`tilepd validate` (and `plan`, `up`) estimates what every GPU must hold and refuses a topology that does not fit,",
        "naming the numbers and the fixes (`model.weights_dtype: fp8`, a larger tensor-parallel size, the longest",
        "`max_seq_len` that fits, `recv_buffer: dram`). `validate` prints the per-GPU table (`--json`: `memory`).",
        "",
        "- **Decode GPU** (tilepd engine, per rank of `tensor_parallel.decode`): its shard of the converted weights at",
        "  `model.weights_dtype`, tensor by tensor from the engine's weight layout (fp8: one byte per value plus one fp32",
        "  scale per 128x128 block; MLA's W_UK/W_UV, norms and embeddings bf16; the router gate as the checkpoint stores it,",
        "  bf16 for DeepSeek-V3.x and GLM-5.1, and its bias fp32), MoE experts and the DSA",
        "  indexer included; the MTP layers (weights and caches); the caches of one `max_seq_len` request in bf16 (MLA's",
        "  latent and the indexer keys are replicated on every rank); on GPU 0 the KV receive buffer when it lives in VRAM",
        "  (the wire format of every layer, plus vLLM's 132-byte indexer keys); a workspace allowance of",
        f"  {WORKSPACE_BYTES / GIB:g} GiB plus the RoPE table.",
        "- **vLLM GPU** (prefill, native decode, when `gpu_type` or `gpu_memory_gib` is stated): its shard of the weights",
        "  vLLM loads (an fp8 checkpoint stays fp8, plus the bf16 W_UK/W_UV vLLM's MLA makes; a bf16 checkpoint is bf16",
        "  unless `--quantization fp8` is in `extra_args`), the KV of one `max_seq_len` request (vLLM will not start without",
        f"  it; indexer cache 132 B per token per layer) and {VLLM_ACTIVATION_BYTES / GIB:g} GiB for activations, against",
        f"  `gpu_memory_utilization` (default {VLLM_DEFAULT_UTILIZATION}) of the GPU.",
        "",
        "Model figures come from `<hf_path>/config.json` when the machine running `validate` can read it (a config whose",
        "features the engine does not implement is refused by rule `model-config`), else from the bundled config of",
        "`model.hf_id`: " + ", ".join(f"`{k}`" for k in KNOWN_MODELS) + ". Otherwise the table says it was not checked.",
        "",
        "| GPU type (`gpu.type` / `gpu_type`) | memory per GPU | source |",
        "| --- | --- | --- |",
    ]
    for aliases, gpu in GPU_TYPES:
        assert known_gpu(aliases[0]) is gpu
        out.append(f"| {', '.join(f'`{a}`' for a in aliases)} | {gpu.memory_bytes / GIB:.1f} GiB | {gpu.source} |")
    out += ["", "Other GPUs: state `decode[].gpu.memory_gib` / `prefill[].gpu_memory_gib` (GiB)."]
    return out


def render_reference() -> str:
    """The whole of docs/TOPOLOGY.md."""
    out = [
        f"# Topology reference (`apiVersion: {API_VERSION}`)",
        "",
        "<!-- generated by `python -m tilepd.topology.reference --write docs/TOPOLOGY.md`; do not edit by hand:",
        "     tests/topology/test_reference.py fails when this file and the schema differ -->",
        "",
        "One YAML file describes a whole deployment. `tilepd validate FILE` checks it (schema, then the",
        "cross-role rules below), `tilepd plan FILE [--json]` shows what each host will run, and",
        "`tilepd render FILE --out DIR` writes the units, env files, configs and Ansible inventory",
        "(layout: docs/INTERFACES.md §5). Worked examples: `topology_examples/` (`glm51-seed.yaml`,",
        "`dsv32-multiconnector.yaml`, `local.yaml`, `lab-3host.yaml`).",
        "",
        "Every mapping refuses unknown keys. Every problem is reported with its place in the file:",
        "",
        "```",
        "topology.yaml:31:16: decode[0].http_port: port 5556 (HTTP port) on 10.1.0.2 is already taken by decode[0].ctrl_port (control port) [port-collision]",
        "```",
        "",
        "Hosts: every entry (prefill, decode, native_decode, router) names its `address`; entries with the",
        "same address are one machine and must agree on `ssh` and `base_dir`. Addresses 127.x, `localhost`",
        "and `::1` are reached without SSH. Services listen on `bind` (default: the address when it is a",
        "loopback address, else `0.0.0.0`).",
        "",
        "## Model families",
        "",
        f"The bundled decode runtime runs {', '.join(f'`{f}`' for f in RUNTIME_FAMILIES)}. Aliases: "
        + ", ".join(f"`{a}` -> `{c}`" for a, c in ALIASES.items())
        + " (GLM-5/5.1 and DeepSeek-V3.2 are DeepSeek-V3-shaped MoE models with MLA attention; their KV handoff "
        "and decode engine are the `deepseek_v3` family's, and the plan renders the canonical name).",
        "",
    ]
    for cls in _models_in_order():
        out += [f"## {cls.__name__}", "", (cls.__doc__ or "").strip().splitlines()[0], "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
        for name, field in cls.model_fields.items():
            key = field.alias or name
            desc = (field.description or "").replace("|", "\\|")
            out.append(f"| `{key}` | {_type_text(field.annotation)}{_constraints(field)} | {_default_text(field)} | {desc} |")
        out.append("")
    out += ["## Rules", "", "Checked after the schema, all at once; each finding names its rule id.", "", "| rule | what it checks |", "| --- | --- |"]
    for rid, text in {**SCHEMA_RULES, **rule_docs()}.items():
        out.append(f"| `{rid}` | {text} |")
    out += ["", *_memory_section()]
    out += ["", "## Exit codes", "", "Every `tilepd` verb (defined in `tilepd/contracts/exit_codes.py`):", "", "| code | name | meaning |", "| --- | --- | --- |"]
    for code in ExitCode:
        out.append(f"| {int(code)} | `{code.name}` | {EXIT_CODE_MEANINGS[code]} |")
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render_reference()
    if len(args) == 2 and args[0] == "--write":
        Path(args[1]).write_text(text)
        return 0
    if args:
        print("usage: python -m tilepd.topology.reference [--write PATH]", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
