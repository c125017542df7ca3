"""Model files on a host, idempotently: the tiny dev model and weight conversion.

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
import hashlib
import json
import shutil
import subprocess
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


def _manifest_digest(out: Path) -> str | None:
    """Hash of every manifest-like file at the top of a converted-weights folder (None if none)."""
    files = sorted(p for p in out.glob("*manifest*") if p.is_file()) if out.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _family_of(hf: Path) -> str:
    cfg = json.loads((hf / "config.json").read_text())
    from tilepd.topology import canonical_family

    model_type = str(cfg.get("model_type", ""))
    return canonical_family({"deepseek_v3": "deepseek_v3", "deepseek_v32": "dsv32", "glm_moe_dsa": "glm5"}.get(model_type, model_type))


def ensure_converted(hf: Path, out: Path, *, family: str | None = None, check: bool = False) -> dict[str, Any]:
    """Run `tilepd convert-weights` into `out`; changed only when the manifest changed.

    The converter itself skips when its manifest matches its inputs; this wrapper
    just observes whether it did anything.
    """
    before = _manifest_digest(out)
    if check:
        # Without running the converter we can only tell "never converted".
        return {"changed": before is None, "path": str(out), "action": "convert" if before is None else "none"}
    if not (hf / "config.json").exists():
        return {"changed": False, "failed": True, "msg": f"HF checkpoint {hf} has no config.json"}
    fam = family or _family_of(hf)
    argv = [sys.executable, "-m", "tilepd", "convert-weights", "--model-dir", str(hf), "--out", str(out), "--family", fam]
    with _locked(out):
        proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()[-2000:]
        return {"changed": False, "failed": True, "rc": proc.returncode, "msg": f"convert-weights failed ({proc.returncode}): {msg}"}
    after = _manifest_digest(out)
    return {"changed": after != before, "path": str(out), "action": "convert" if after != before else "none"}


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
    c.add_argument("--family")
    c.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.verb == "tiny":
        result = ensure_tiny(args.family, args.out, seed=args.seed, check=args.check)
    else:
        result = ensure_converted(args.hf, args.out, family=args.family, check=args.check)
    print(json.dumps(result))
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
