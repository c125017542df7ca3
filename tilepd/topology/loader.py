"""load_topology: file -> validated Topology, or every finding with its file:line:col."""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from tilepd.topology import rules
from tilepd.topology.errors import Finding, TopologyError, TopologyFileError
from tilepd.topology.home import expand_home
from tilepd.topology.schema import API_VERSION, Topology
from tilepd.topology.yaml_source import MAX_BYTES, Loc, SourceMap, parse_yaml


def load_topology(path: str | Path) -> Topology:
    """Read, parse and validate a topology file.

    Raises TopologyFileError (missing, unreadable, not YAML) or TopologyError (schema
    or rule findings, all of them at once).
    """
    file = str(path)
    try:
        with open(path, "rb") as fh:  # bounded: /dev/zero or a 10 GB file must not be read whole
            raw = fh.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise TopologyFileError(file, f"larger than a topology file may be ({MAX_BYTES} bytes); a topology of 2,000 hosts is ~300 KB")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise TopologyFileError(file, "no such file") from None
    except IsADirectoryError:
        raise TopologyFileError(file, "is a directory, not a topology file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyFileError(file, f"cannot read: {exc}") from None
    return load_topology_text(text, file)


def load_topology_text(text: str, file: str = "<string>") -> Topology:
    """Like load_topology, for text already in memory (`file` names it in messages)."""
    data, smap = parse_yaml(text, file)
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise TopologyError([Finding(file, 1, 1, "", f"a topology is a YAML mapping with apiVersion: {API_VERSION}; this document is {kind}", "schema.invalid")])
    expand_home(data)  # `~/...` paths of an all-loopback deployment: the operator's own home
    try:
        topo = Topology.model_validate(data)
    except ValidationError as exc:
        raise TopologyError([_schema_finding(err, smap) for err in exc.errors()]) from None
    findings = [_rule_finding(v, smap) for v in rules.check(topo)]
    if findings:
        raise TopologyError(findings)
    return topo


def _rule_finding(v: rules.Violation, smap: SourceMap) -> Finding:
    line, col = smap.position(v.loc)
    return Finding(smap.file, line, col, rules.loc_str(v.loc), v.message, v.rule)


def _schema_finding(err: Any, smap: SourceMap) -> Finding:
    loc: Loc = tuple(p for p in err["loc"] if isinstance(p, (str, int)))
    kind = err["type"]
    if kind == "extra_forbidden":
        key = str(loc[-1])
        allowed = _allowed_keys(loc[:-1])
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else (f"; allowed: {', '.join(sorted(allowed))}" if allowed else "")
        line, col = smap.position(loc, prefer_key=True)
        return Finding(smap.file, line, col, rules.loc_str(loc), f"unknown key {key!r}{hint}", "schema.unknown-key")
    if kind == "missing":
        line, col = smap.position(loc[:-1])
        return Finding(smap.file, line, col, rules.loc_str(loc), f"required key {loc[-1]!r} is missing", "schema.missing")
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if kind == "literal_error" and isinstance(err.get("input"), str):
        options = _literal_options(loc)
        close = difflib.get_close_matches(err["input"], options, n=1, cutoff=0.5)
        if loc == ("apiVersion",):
            message = f"this tilepd reads apiVersion {API_VERSION} only"
        elif close and len(options) > 1:
            message += f"; did you mean {close[0]!r}?"
    if "input" in err and kind not in ("model_type", "dict_type", "list_type") and not isinstance(err["input"], (dict, list)):
        message += f" (got {err['input']!r})"
    line, col = smap.position(loc)
    return Finding(smap.file, line, col, rules.loc_str(loc), message, "schema.invalid")


def _unwrap(annotation: Any) -> list[Any]:
    """The concrete types inside Optional/Union/list/dict annotations."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _unwrap(arg)]
    return [annotation]


def _field_map(cls: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f.annotation for name, f in cls.model_fields.items()}


def _walk_type(loc: Loc) -> list[Any]:
    """Annotations reachable at `loc` starting from Topology."""
    current: list[Any] = [Topology]
    for part in loc:
        nxt: list[Any] = []
        for ann in current:
            for t in _unwrap(ann):
                origin = typing.get_origin(t)
                if isinstance(part, int) and origin in (list, tuple):
                    nxt.extend(typing.get_args(t)[:1])
                elif isinstance(part, str) and origin is dict:
                    nxt.append(typing.get_args(t)[1])
                elif isinstance(part, str) and isinstance(t, type) and issubclass(t, BaseModel):
                    fm = _field_map(t)
                    if part in fm:
                        nxt.append(fm[part])
        current = nxt
    return current


def _allowed_keys(loc: Loc) -> list[str]:
    keys: list[str] = []
    for ann in _walk_type(loc):
        for t in _unwrap(ann):
            if isinstance(t, type) and issubclass(t, BaseModel):
                keys.extend(_field_map(t))
    return keys


def _literal_options(loc: Loc) -> list[str]:
    out: list[str] = []
    for ann in _walk_type(loc):
        for t in _unwrap(ann):
            if typing.get_origin(t) is typing.Literal:
                out.extend(str(a) for a in typing.get_args(t))
    return out
