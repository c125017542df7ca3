"""docs/TOPOLOGY.md is exactly what the schema, rules and exit codes generate: it cannot drift."""

from __future__ import annotations

from pathlib import Path

from tilepd.contracts.exit_codes import ExitCode
from tilepd.topology.reference import EXIT_CODE_MEANINGS, render_reference
from tilepd.topology.rules import RULES
from tilepd.topology.schema import DecodeNode, Topology

DOC = Path(__file__).resolve().parents[2] / "docs" / "TOPOLOGY.md"


def test_topology_md_matches_the_schema() -> None:
    assert DOC.read_text() == render_reference(), "docs/TOPOLOGY.md is stale: run `python -m tilepd.topology.reference --write docs/TOPOLOGY.md`"


def test_reference_covers_every_key_rule_and_exit_code() -> None:
    text = render_reference()
    for cls in (Topology, DecodeNode):
        for name, field in cls.model_fields.items():
            assert f"| `{field.alias or name}` |" in text
    for rule in RULES:
        assert f"| `{rule}` |" in text
    assert set(EXIT_CODE_MEANINGS) == set(ExitCode)
