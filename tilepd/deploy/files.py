"""Write a host's rendered files in one step: `python -m tilepd.deploy.files apply` (manifest on stdin).

One Ansible `copy` per file costs two module round trips per file and host; a
deployment has a dozen small files per host. Sending them as one JSON manifest
through `command`'s stdin makes it a single round trip, still idempotent (a file is
rewritten only when its content or mode differs, atomically) and still honest in
`--check` (it reports what would change and writes nothing).

Manifest: {"dirs": [path...], "files": [{"path", "content", "mode": "0644"}...]}.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any


def _needs_write(path: Path, content: bytes, mode: int) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return True
    if stat.S_IMODE(st.st_mode) != mode or st.st_size != len(content):
        return True
    return path.read_bytes() != content


def _write_atomic(path: Path, content: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def apply(manifest: dict[str, Any], *, check: bool = False) -> dict[str, Any]:
    """Create missing dirs and (re)write differing files; report what changed."""
    created: list[str] = []
    written: list[str] = []
    for d in manifest.get("dirs", []):
        p = Path(d)
        if not p.is_dir():
            created.append(d)
            if not check:
                p.mkdir(parents=True, exist_ok=True)
    for entry in manifest.get("files", []):
        path = Path(entry["path"])
        content = entry["content"].encode()
        mode = int(str(entry.get("mode", "0644")), 8)
        if _needs_write(path, content, mode):
            written.append(str(path))
            if not check:
                _write_atomic(path, content, mode)
    return {"changed": bool(created or written), "dirs_created": created, "written": written}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "apply":
        print(json.dumps({"failed": True, "changed": False, "msg": "usage: python -m tilepd.deploy.files apply [--check] < manifest.json"}))
        return 2
    try:
        manifest = json.load(sys.stdin)
        result = apply(manifest, check="--check" in args[1:])
    except (ValueError, KeyError, OSError) as e:
        print(json.dumps({"failed": True, "changed": False, "msg": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
