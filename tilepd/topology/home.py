"""`~` in a topology's paths: the operator's own home, so an all-local deployment is per user.

A leading `~` (alone or as `~/...`) is replaced by the home folder of the user running tilepd,
before validation, in: deployment.base_dir / python, model.hf_path / weights_path, each
entry's base_dir / python, each router's api_key.file (only when every host is a loopback address:
the paths are used on the hosts, and only then are the hosts this machine), and ssh.key_file
(always: the key is read on the controller). Anywhere else a `~` path stays as written and
rule `absolute-path` refuses it, naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tilepd.topology.rules import is_loopback

ENTRY_LISTS = ("prefill", "decode", "native_decode", "routers")
SINGLE_ENTRIES = ("router", "balancer")


def _entries(data: dict[str, Any]) -> list[dict[str, Any]]:
    lists = [data.get(key) for key in ENTRY_LISTS]
    out = [e for entries in lists if isinstance(entries, list) for e in entries if isinstance(e, dict)]
    out += [data[key] for key in SINGLE_ENTRIES if isinstance(data.get(key), dict)]
    return out


def _expand(mapping: Any, key: str, home: str) -> None:
    if not isinstance(mapping, dict):
        return
    value = mapping.get(key)
    if isinstance(value, str) and (value == "~" or value.startswith("~/")):
        mapping[key] = home + value[1:]


def expand_home(data: Any, home: Path | None = None) -> None:
    """Expand `~` in place in a parsed (not yet validated) topology; see the module docstring for where."""
    if not isinstance(data, dict):
        return
    h = str(home or Path.home()).rstrip("/") or "/"
    entries = _entries(data)
    for entry in entries:
        _expand(entry.get("ssh"), "key_file", h)
    addresses = [e.get("address") for e in entries]
    if not addresses or not all(isinstance(a, str) and is_loopback(a) for a in addresses):
        return
    for key in ("base_dir", "python"):
        _expand(data.get("deployment"), key, h)
    for key in ("hf_path", "weights_path"):
        _expand(data.get("model"), key, h)
    for entry in entries:
        _expand(entry, "base_dir", h)
        _expand(entry, "python", h)
    routers = [data.get("router"), *(data.get("routers") if isinstance(data.get("routers"), list) else [])]
    for router in routers:
        if isinstance(router, dict):
            _expand(router.get("api_key"), "file", h)
