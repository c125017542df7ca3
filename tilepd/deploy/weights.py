"""Model files on a host, idempotently: the tiny dev model, weight conversion, and their purge.

Called by the `weights` role (`python -m tilepd.deploy.weights tiny|convert ...`); prints
one JSON line whose `changed` drives Ansible's changed_when, so a second `up` reports
ok rather than changed. Hosts on one machine (namespaces, local.yaml) share the
filesystem and may ask for the same path at once: work happens under a file lock
into a temporary sibling that is renamed into place, so nobody sees half a model.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import posixpath
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_TINY_MARKER = ".tilepd-tiny.json"


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tiny_present(out: Path, family: str, seed: int) -> bool:
    try:
        marker = json.loads((out / _TINY_MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return marker == {"family": family, "seed": seed} and (out / "config.json").exists()


def ensure_tiny(family: str, out: Path, *, seed: int = 0, check: bool = False) -> dict[str, Any]:
    """Generate the tiny model of `family` at `out` unless it is already there."""
    if _tiny_present(out, family, seed):
        return {"changed": False, "path": str(out)}
    if out.exists() and not (out / _TINY_MARKER).exists() and any(out.iterdir()):
        return {"changed": False, "failed": True, "msg": f"{out} holds files that are not tilepd's tiny model; refusing to overwrite"}
    if check:
        return {"changed": True, "path": str(out), "action": "generate"}
    from tilepd.dev.tiny_model import make_tiny_model

    with _locked(out):
        if _tiny_present(out, family, seed):  # another host on this machine made it meanwhile
            return {"changed": False, "path": str(out)}
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_model(family, tmp, seed=seed)
        (tmp / _TINY_MARKER).write_text(json.dumps({"family": family, "seed": seed}))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return {"changed": True, "path": str(out), "action": "generate"}


def ensure_converted(hf: Path, out: Path, *, family: str, dtype: str, tp: int = 1, check: bool = False) -> dict[str, Any]:
    """Convert `hf` into `out` unless the converter's manifest says these inputs are already there."""
    from tilepd.weights.convert import convert_weights
    from tilepd.weights.manifest import is_up_to_date, read_manifest
    from tilepd.weights.source import WeightsError

    if check:
        if not (hf / "config.json").exists():
            return {"changed": True, "path": str(out), "action": "convert (checkpoint not there yet)"}
        try:
            up_to_date, _ = is_up_to_date(read_manifest(out), hf, out, {"family": family, "dtype": dtype, "tp": tp})
        except (OSError, ValueError) as e:
            return {"changed": True, "path": str(out), "action": f"convert ({e})"}
        return {"changed": not up_to_date, "path": str(out), "action": "none" if up_to_date else "convert"}
    try:
        with _locked(out):  # decode nodes on one machine share the path
            result = convert_weights(hf, out, family=family, dtype=dtype, tp=tp, progress=False)
    except (WeightsError, ValueError, OSError) as e:
        return {"changed": False, "failed": True, "msg": f"convert-weights {hf} -> {out}: {e} (no manifest written)"}
    return {"changed": not result.skipped, "path": str(out), "action": "none" if result.skipped else "convert",
            "seconds": round(result.seconds, 3), "tensors": result.tensors}  # fmt: skip


def purge_refusal(weights: str, hf: str, base_dirs: list[str]) -> str | None:
    """Why deleting `weights` recursively would take what must survive (None when it would not).

    Refused: a weights_path that equals, contains or lies inside hf_path (the checkpoint the deployment cannot
    rebuild), or that equals or contains a base_dir (configs, logs, pid files, secrets) or is the filesystem root.
    Paths are compared after normalisation; on the host they are resolved first (symlinks, `..`)."""
    w, h = posixpath.normpath(weights), posixpath.normpath(hf)

    def within(inner: str, outer: str) -> bool:
        return inner == outer or inner.startswith(outer.rstrip("/") + "/")

    if w == "/":
        return f"weights_path {weights} is the filesystem root"
    if within(h, w) or within(w, h):
        how = "equals" if w == h else ("contains" if within(h, w) else "lies inside")
        return f"weights_path {weights} {how} hf_path {hf}: deleting it would delete the checkpoint"
    for b in base_dirs:
        if within(posixpath.normpath(b), w):
            how = "equals" if posixpath.normpath(b) == w else "contains"
            return f"weights_path {weights} {how} base_dir {b}: deleting it would delete the deployment's configs, logs and secrets"
    return None


def purge(weights: Path, hf: Path, base_dirs: list[Path], *, check: bool = False) -> dict[str, Any]:
    """Delete the converted weights unless purge_refusal (on the paths as this host resolves them) says no."""
    real = [os.path.realpath(p) for p in (weights, hf, *base_dirs)]
    why = purge_refusal(str(weights), str(hf), [str(b) for b in base_dirs]) or purge_refusal(real[0], real[1], real[2:])
    if why:
        return {"failed": True, "changed": False, "path": str(weights), "msg": f"refusing to purge: {why}"}
    present = weights.exists() or weights.is_symlink()
    if present and not check:
        if weights.is_symlink() or not weights.is_dir():
            weights.unlink()
        else:
            shutil.rmtree(weights)
    return {"changed": present, "path": str(weights), "action": "purge" if present else "none"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tilepd.deploy.weights")
    sub = parser.add_subparsers(dest="verb", required=True)
    t = sub.add_parser("tiny", help="generate the tiny dev model unless present")
    t.add_argument("--family", required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--check", action="store_true")
    c = sub.add_parser("convert", help="convert HF weights unless the manifest matches")
    c.add_argument("--hf", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--family", required=True)
    c.add_argument("--dtype", default="bf16")
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--check", action="store_true")
    p = sub.add_parser("purge", help="delete the converted weights, unless that would take hf_path or a base_dir")
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--base-dir", type=Path, action="append", default=[])
    p.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.verb == "tiny":
        result = ensure_tiny(args.family, args.out, seed=args.seed, check=args.check)
    elif args.verb == "purge":
        result = purge(args.weights, args.hf, args.base_dir, check=args.check)
    else:
        result = ensure_converted(args.hf, args.out, family=args.family, dtype=args.dtype, tp=args.tp, check=args.check)
    print(json.dumps(result))
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
