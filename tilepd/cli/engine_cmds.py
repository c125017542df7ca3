"""Engine-side verbs: `convert-weights` and the `dev` helpers (tiny models for tests and demos)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from tilepd.contracts.exit_codes import ExitCode

dev_app = typer.Typer(name="dev", help="Developer helpers: tiny deterministic models for tests and demos.", no_args_is_help=True)


@dev_app.command("tiny-model")
def tiny_model(
    family: str = typer.Argument(..., help="Model: llama, deepseek_v3, or the sparse-attention (DSA) models glm5 (glm_moe_dsa), dsv32 (deepseek_v32)."),
    out: Path = typer.Argument(..., help="Directory to write the HF checkpoint into."),
    seed: int = typer.Option(0, help="Seed of the random weights (same seed, same bytes)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Write a tiny random HF checkpoint (weights, tokenizer, chat template) that vLLM and transformers load."""
    from tilepd.dev.tiny_model import FAMILIES, make_tiny_model

    if family not in FAMILIES:
        typer.echo(f"tilepd dev tiny-model: unknown family {family!r}; choose one of {', '.join(FAMILIES)}", err=True)
        raise typer.Exit(int(ExitCode.USAGE))
    path = make_tiny_model(family, out, seed=seed)
    if as_json:
        typer.echo(json.dumps({"family": family, "path": str(path), "seed": seed}))
    else:
        typer.echo(f"wrote tiny {family} model to {path}")


def _fail(code: ExitCode, message: str) -> None:
    typer.echo(f"tilepd convert-weights: {message}", err=True)
    raise typer.Exit(int(code))


def convert_weights_cmd(
    topology: Path | None = typer.Argument(None, help="Topology file: convert for every decode node (instead of --model-dir/--out)."),
    model_dir: Path | None = typer.Option(None, "--model-dir", help="HF checkpoint directory (config.json + *.safetensors)."),
    out: Path | None = typer.Option(None, "--out", help="Output directory of the tilepd runtime weights."),
    family: str | None = typer.Option(None, "--family", help="Expected family (llama | deepseek_v3); checked against config.json."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 | fp16 | fp32 | fp8 (fp8: GEMV weights block-scaled e4m3, 128x128 blocks; an fp8 checkpoint's scales are kept)."),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel ranks: one rank<r>.safetensors shard per rank."),
    force: bool = typer.Option(False, "--force", help="Convert even when the manifest says the inputs are unchanged."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per conversion instead of a progress bar."),
    local: bool = typer.Option(False, "--local", help="TOPOLOGY form: convert here, for every decode node, instead of on the nodes through Ansible."),
    limit: str | None = typer.Option(None, "--limit", help="TOPOLOGY form (Ansible): only these hosts (Ansible limit pattern)."),
    check: bool = typer.Option(False, "--check", help="TOPOLOGY form (Ansible): report what would be converted, change nothing."),
) -> None:
    """Convert an HF safetensors checkpoint into tilepd's runtime format (skips when already up to date).

    With a TOPOLOGY file, every decode node converts its own copy through Ansible (the same playbooks as `tilepd up`); --local converts on this machine instead."""
    from tilepd.weights.errors import WeightsError

    if family is not None:
        from tilepd.topology.families import canonical_family

        family = canonical_family(family) or family
    try:
        if topology is not None:
            if model_dir or out:
                _fail(ExitCode.USAGE, "give either a TOPOLOGY file or --model-dir/--out, not both")
            if not local:
                from tilepd.deploy.convert_on_nodes import convert_on_nodes

                raise typer.Exit(convert_on_nodes(topology, limit=limit, check=check))
            results = _convert_topology(topology, as_json, force)
        else:
            if model_dir is None or out is None:
                _fail(ExitCode.USAGE, "--model-dir and --out are required (or give a TOPOLOGY file)")
            if out.exists() and not out.is_dir():
                _fail(ExitCode.USAGE, f"--out {out}: exists and is not a directory; give a new or existing folder")
            results = [({"model_dir": str(model_dir)}, _convert_one(model_dir, out, family, dtype, tp, as_json, force))]
    except WeightsError as e:
        _fail(ExitCode.INPUT, f"{e} (no manifest written)")
    except ValueError as e:
        _fail(ExitCode.USAGE, str(e))
    except OSError as e:  # an --out that cannot be created or written (read-only, /proc, no permission)
        if out is None or not e.filename or not str(e.filename).startswith(str(out)):
            raise
        _fail(ExitCode.USAGE, f"cannot write --out {out}: {e.strerror or e} ({e.filename})")
    for info, r in results:
        if as_json:
            typer.echo(json.dumps({**info, "out": str(r.out_dir), "skipped": r.skipped, "seconds": round(r.seconds, 3),
                                   "tensors": r.tensors, "bytes": r.bytes_written, "files": r.files}))
        elif r.skipped:
            typer.echo(f"{r.out_dir}: up to date (manifest matches the sources), skipped in {r.seconds:.2f} s")
        else:
            typer.echo(f"{r.out_dir}: wrote {r.tensors} tensors, {r.bytes_written / 1e9:.3f} GB in {r.seconds:.1f} s")


def _convert_one(model_dir: Path, out: Path, family: str | None, dtype: str, tp: int, as_json: bool, force: bool) -> Any:
    """Torch-free skip check first: an unchanged re-run answers without importing torch."""
    import time
    from types import SimpleNamespace

    from tilepd.weights.skip import resolve_options, try_skip

    t0 = time.perf_counter()
    if not force and try_skip(model_dir, out, resolve_options(model_dir, family, dtype, tp)):
        return SimpleNamespace(out_dir=out, skipped=True, seconds=time.perf_counter() - t0, tensors=0, bytes_written=0, files=[])
    from tilepd.weights.convert import convert_weights

    return convert_weights(model_dir, out, family=family, dtype=dtype, tp=tp, progress=not as_json, force=True)


def _convert_topology(path: Path, as_json: bool, force: bool) -> list:
    from tilepd.topology.errors import TopologyError, TopologyFileError
    from tilepd.deploy.local_convert import jobs_from_topology, run_job

    try:
        jobs = jobs_from_topology(path)
    except TopologyError as e:
        _fail(ExitCode.INVALID, str(e))
    except TopologyFileError as e:
        _fail(ExitCode.INPUT, str(e))
    out = []
    for job in jobs:
        info = {"nodes": list(job.nodes), "model_dir": str(job.hf_path), "dtype": job.dtype, "tp": job.tp}
        out.append((info, run_job(job, progress=not as_json, force=force)))
    return out


def register(app: typer.Typer) -> None:
    app.command("convert-weights")(convert_weights_cmd)
    app.add_typer(dev_app, name="dev")
