"""Read YAML while remembering where every key and value came from.

PyYAML's composer (libyaml's C parser when available: a 1000-node topology parses in
well under a second, where a pure-Python round-trip loader takes seconds) gives each
node its start line/column. We construct plain Python values from the node tree
ourselves and record positions in a flat index keyed by field path, so schema errors
(pydantic locs) and rule findings both point at the exact place in the file.

Input is bounded: the composer shares an anchored node between its aliases, but the
values built here are copies, so a 1 KB file of nested aliases ("billion laughs")
would expand without end. Building stops past MAX_VALUES values (aliases and merge
keys included; MAX_ALIAS_VALUES of them through aliases) or MAX_DEPTH levels of
nesting, and the loader refuses files over
MAX_BYTES, each with a located error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from tilepd.topology.errors import TopologyFileError

Loc = tuple[str | int, ...]

_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"

# A topology of 2,000 hosts is ~300 KB and ~25,000 values; these bounds leave room for that, stop an
# alias bomb within a fraction of a second and a few MB, and keep the C parser's own work to seconds
# (composing 512 KiB of dense flow items: ~2 s on one core).
MAX_BYTES = 512 << 10
MAX_VALUES = 50_000
MAX_ALIAS_VALUES = 10_000  # values built again because an alias (or merge key) points at them
MAX_DEPTH = 32


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
    """Node tree -> plain dicts/lists/scalars, recording positions on the way (bounded: see the module doc)."""

    def __init__(self, loader: Any, smap: SourceMap):
        self.loader = loader
        self.smap = smap
        self.values = 0
        self.alias_values = 0
        self.built: set[int] = set()  # ids of collection nodes built once: building one again is an alias
        self.in_alias = 0

    def _refuse(self, node: yaml.Node, message: str) -> TopologyFileError:
        line, col = _pos(node)
        return TopologyFileError(self.smap.file, message, line, col)

    def _count(self, node: yaml.Node, depth: int) -> None:
        """One more value built (or mapping merged) at nesting `depth`; refuse past the bounds."""
        self.values += 1
        if self.in_alias:
            self.alias_values += 1
            if self.alias_values > MAX_ALIAS_VALUES:
                raise self._refuse(node, f"YAML aliases expand to more than {MAX_ALIAS_VALUES} values; a topology needs far fewer "
                                         "(nested aliases that multiply are refused)")
        if self.values > MAX_VALUES:
            raise self._refuse(node, f"more than {MAX_VALUES} values once YAML aliases and merge keys are expanded; "
                                     "a topology needs far fewer (nested aliases that multiply are refused)")
        if depth > MAX_DEPTH:
            raise self._refuse(node, f"nested deeper than {MAX_DEPTH} levels (aliases and merge keys included); a topology needs far fewer")

    def build(self, node: yaml.Node, loc: Loc) -> Any:
        if isinstance(node, yaml.CollectionNode):
            alias = id(node) in self.built
            self.built.add(id(node))
            self.in_alias += alias
            try:
                return self._collection(node, loc)
            finally:
                self.in_alias -= alias
        self._count(node, len(loc))
        self.smap.values[loc] = _pos(node)
        if node.tag == _STR_TAG:
            return node.value  # the common case, without the constructor's bookkeeping
        return self._construct(node)

    def _collection(self, node: yaml.CollectionNode, loc: Loc) -> Any:
        self._count(node, len(loc))
        self.smap.values[loc] = _pos(node)
        self.smap.containers.add(loc)
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, loc, 0)
        return [self.build(item, loc + (i,)) for i, item in enumerate(node.value)]

    def _construct(self, node: yaml.Node) -> Any:
        """A scalar by SafeLoader's rules; values its constructors reject (a 13th month) are located errors."""
        try:
            return self.loader.construct_object(node, deep=True)
        except (ValueError, TypeError, OverflowError, IndexError, KeyError) as exc:  # `!!int ` (empty): IndexError in PyYAML
            raise self._refuse(node, f"not valid YAML for a topology: {node.value!r} cannot be read as {node.tag.rsplit(':', 1)[-1]} ({exc})") from None

    def _mapping(self, node: yaml.MappingNode, loc: Loc, merge_depth: int) -> dict[str, Any]:
        """A mapping; `<<` merge keys as SafeLoader reads them (own keys win; of several merged
        mappings the first listed wins), built here so that their expansion counts against the bounds."""
        out: dict[str, Any] = {}
        own: set[str] = set()
        merges: list[yaml.Node] = []
        pairs: list[tuple[str, yaml.Node, yaml.Node]] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                subs = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                if not all(isinstance(sub, yaml.MappingNode) for sub in subs):
                    raise self._refuse(value_node, "not valid YAML for a topology: a merge key `<<` takes a mapping or a list of mappings")
                merges.extend(subs)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise self._refuse(key_node, "not valid YAML for a topology: a mapping key must be a plain word, not a mapping or list")
            key = self._construct(key_node)
            if not isinstance(key, (str, int, float, bool)):
                raise self._refuse(key_node, f"not valid YAML for a topology: unsupported mapping key {key!r}")
            name = key if isinstance(key, str) else str(key)
            if name in own:
                raise self._refuse(key_node, f"duplicate key {name!r} in one mapping")
            own.add(name)
            pairs.append((name, key_node, value_node))
        for sub in reversed(merges):  # the first listed is applied last, so it wins
            alias = id(sub) in self.built
            self.built.add(id(sub))
            self.in_alias += alias
            try:
                self._count(sub, len(loc) + merge_depth + 1)
                out.update(self._mapping(sub, loc, merge_depth + 1))
            finally:
                self.in_alias -= alias
        self.smap.values[loc] = _pos(node)
        for name, key_node, value_node in pairs:
            child = loc + (name,)
            self.smap.keys[child] = _pos(key_node)
            out[name] = self.build(value_node, child)
        return out


def parse_yaml(text: str, file: str) -> tuple[Any, SourceMap]:
    """Parse one YAML document; raise TopologyFileError with the YAML error's position."""
    smap = SourceMap(file=file)
    if len(text) > MAX_BYTES:  # characters, at least as many bytes
        raise TopologyFileError(file, f"{len(text)} characters is larger than a topology file may be ({MAX_BYTES} bytes)")
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
