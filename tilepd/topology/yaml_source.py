"""Read YAML while remembering where every key and value came from.

ruamel.yaml's round-trip loader records line/column of each key and value; we copy
those into a flat index keyed by the field path so that schema errors (pydantic locs)
and rule findings can both point at the exact place in the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from tilepd.topology.errors import TopologyFileError

Loc = tuple[str | int, ...]


@dataclass
class SourceMap:
    """Positions (1-based line, col) of keys and values, by field path."""

    file: str
    keys: dict[Loc, tuple[int, int]] = field(default_factory=dict)
    values: dict[Loc, tuple[int, int]] = field(default_factory=dict)

    def position(self, loc: Loc, prefer_key: bool = False) -> tuple[int, int]:
        """Best position for `loc`: the value (or key), else the nearest ancestor's."""
        loc = tuple(loc)
        while True:
            first, second = (self.keys, self.values) if prefer_key else (self.values, self.keys)
            if loc in first:
                return first[loc]
            if loc in second:
                return second[loc]
            if not loc:
                return (1, 1)
            loc = loc[:-1]


def _walk(node: Any, loc: Loc, smap: SourceMap) -> Any:
    """Convert ruamel containers to plain dicts/lists, recording positions on the way."""
    if isinstance(node, CommentedMap):
        out: dict[Any, Any] = {}
        for key, value in node.items():
            child = loc + (str(key),)
            try:
                kl, kc = node.lc.key(key)
                smap.keys[child] = (kl + 1, kc + 1)
                vl, vc = node.lc.value(key)
                smap.values[child] = (vl + 1, vc + 1)
            except (KeyError, TypeError):
                pass
            out[str(key) if not isinstance(key, (int, float, bool)) else key] = _walk(value, child, smap)
        return out
    if isinstance(node, CommentedSeq):
        items = []
        for i, value in enumerate(node):
            child = loc + (i,)
            try:
                il, ic = node.lc.item(i)
                smap.values[child] = (il + 1, ic + 1)
            except (KeyError, TypeError, IndexError):
                pass
            items.append(_walk(value, child, smap))
        return items
    if isinstance(node, str):
        return str(node)  # drop ruamel's scalar subclasses
    return node


def parse_yaml(text: str, file: str) -> tuple[Any, SourceMap]:
    """Parse one YAML document; raise TopologyFileError with the YAML error's position."""
    yaml = YAML(typ="rt")
    try:
        data = yaml.load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (0, 0)
        problem = " ".join(p for p in (exc.context, exc.problem) if p) or str(exc)
        raise TopologyFileError(file, f"not valid YAML: {problem}", line, col) from None
    except YAMLError as exc:
        raise TopologyFileError(file, f"not valid YAML: {exc}") from None
    smap = SourceMap(file=file)
    if isinstance(data, CommentedMap):
        smap.values[()] = (data.lc.line + 1, data.lc.col + 1)
    return _walk(data, (), smap), smap
