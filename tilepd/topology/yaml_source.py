"""Read YAML while remembering where every key and value came from.

PyYAML's composer (libyaml's C parser when available: a 1000-node topology parses in
well under a second, where a pure-Python round-trip loader takes seconds) gives each
node its start line/column. We construct plain Python values from the node tree
ourselves and record positions in a flat index keyed by field path, so schema errors
(pydantic locs) and rule findings both point at the exact place in the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from tilepd.topology.errors import TopologyFileError

Loc = tuple[str | int, ...]

_STR_TAG = "tag:yaml.org,2002:str"


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader that skips the implicit-type regexes for scalars that cannot match one."""

    def resolve(self, kind: type, value: Any, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode:
            if not implicit[0]:
                return _STR_TAG  # quoted: always a string
            if value and value[0] not in self.yaml_implicit_resolvers:
                return _STR_TAG  # no implicit type starts with this character
        return super().resolve(kind, value, implicit)


@dataclass
class SourceMap:
    """Positions (1-based line, col) of keys and values, by field path."""

    file: str
    keys: dict[Loc, tuple[int, int]] = field(default_factory=dict)
    values: dict[Loc, tuple[int, int]] = field(default_factory=dict)
    containers: set[Loc] = field(default_factory=set)  # locs whose value is a mapping or a list

    def position(self, loc: Loc, prefer_key: bool | None = None) -> tuple[int, int]:
        """Best position for `loc`, else the nearest ancestor's.

        A scalar is pointed at by its value; a mapping or list by its key (a block
        collection's value starts on the next line, which reads as the wrong place).
        """
        loc = tuple(loc)
        if prefer_key is None:
            prefer_key = loc in self.containers
        while True:
            first, second = (self.keys, self.values) if prefer_key else (self.values, self.keys)
            if loc in first:
                return first[loc]
            if loc in second:
                return second[loc]
            if not loc:
                return (1, 1)
            loc = loc[:-1]


def _pos(node: yaml.Node) -> tuple[int, int]:
    return (node.start_mark.line + 1, node.start_mark.column + 1)


class _Builder:
    """Node tree -> plain dicts/lists/scalars, recording positions on the way."""

    def __init__(self, loader: Any, smap: SourceMap):
        self.loader = loader
        self.smap = smap

    def build(self, node: yaml.Node, loc: Loc) -> Any:
        self.smap.values[loc] = _pos(node)
        if isinstance(node, yaml.MappingNode):
            self.smap.containers.add(loc)
            self.loader.flatten_mapping(node)  # resolves `<<` merge keys like SafeLoader does
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self.loader.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool)) or key is None:
                    line, col = _pos(key_node)
                    raise TopologyFileError(self.smap.file, f"not valid YAML for a topology: unsupported mapping key {key!r}", line, col)
                name = key if isinstance(key, str) else str(key)
                if name in out:
                    line, col = _pos(key_node)
                    raise TopologyFileError(self.smap.file, f"duplicate key {name!r} in one mapping", line, col)
                child = loc + (name,)
                self.smap.keys[child] = _pos(key_node)
                out[name] = self.build(value_node, child)
            return out
        if isinstance(node, yaml.SequenceNode):
            self.smap.containers.add(loc)
            return [self.build(item, loc + (i,)) for i, item in enumerate(node.value)]
        if node.tag == _STR_TAG:
            return node.value  # the common case, without the constructor's bookkeeping
        return self.loader.construct_object(node, deep=True)


def parse_yaml(text: str, file: str) -> tuple[Any, SourceMap]:
    """Parse one YAML document; raise TopologyFileError with the YAML error's position."""
    smap = SourceMap(file=file)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        data = None if node is None else _Builder(loader, smap).build(node, ())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (0, 0)
        problem = " ".join(p for p in (exc.context, exc.problem) if p) or str(exc)
        raise TopologyFileError(file, f"not valid YAML: {problem}", line, col) from None
    except yaml.YAMLError as exc:
        raise TopologyFileError(file, f"not valid YAML: {exc}") from None
    finally:
        loader.dispose()
    return data, smap
