"""tilepd.topology: the topology schema, its YAML loader (with positions) and cross-role rules.

Public API: `load_topology(path) -> Topology`, raising `TopologyError` (findings, exit 3)
or `TopologyFileError` (missing / unreadable / not YAML, exit 4).
"""

from tilepd.topology.errors import Finding, TopologyError, TopologyFileError
from tilepd.topology.families import canonical_family
from tilepd.topology.loader import load_topology, load_topology_text
from tilepd.topology.schema import API_VERSION, Topology

__all__ = [
    "API_VERSION",
    "Finding",
    "Topology",
    "TopologyError",
    "TopologyFileError",
    "canonical_family",
    "load_topology",
    "load_topology_text",
]
