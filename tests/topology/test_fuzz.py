"""Property-based fuzzing of the topology loader and rules: whatever the input, `validate` answers with a topology,
located findings (exit 3) or a located file error (exit 4): never a traceback, never a hang.

Examples are few (CI runs this on 2 shared cores); each has a deadline, so a slow input fails the test too.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tilepd.cli.app import app
from tilepd.resources import examples_dir
from tilepd.topology import Topology, TopologyError, TopologyFileError, load_topology_text

BASE_TEXT = (Path(__file__).parent / "base_valid.yaml").read_text()
BASE = yaml.safe_load(BASE_TEXT)
SEED = yaml.safe_load((examples_dir() / "glm51-seed.yaml").read_text())
FUZZ = settings(max_examples=60, deadline=3000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _answers(text: str) -> None:
    """The loader's contract: a Topology, or one of its two located errors."""
    try:
        assert isinstance(load_topology_text(text, "fuzz.yaml"), Topology)
    except TopologyError as exc:
        assert exc.findings and all(f.file == "fuzz.yaml" and f.line >= 0 and f.col >= 0 and f.rule and f.message for f in exc.findings)
    except TopologyFileError as exc:
        assert exc.file == "fuzz.yaml" and exc.message


# YAML-ish text: the characters YAML gives meaning to, words of a topology, and anchors/aliases
_TOKENS = st.sampled_from([
    "\n", "  ", " ", ":", "- ", "[", "]", "{", "}", ",", "&a ", "*a", "&b ", "*b", "<<: ", "!!str ", "!!int ", "!!binary ", "? ", "|", ">",
    "#", "'", '"', "---\n", "...\n", "%YAML 1.1\n", "~", "null", "true", "1e400", "0x1F", "2001-13-45", "apiVersion", "tilepd/v1",
    "model", "decode", "gpu", "prefill", "port", "name", "\t", "\x00", "\ufeff", "é",
])


@FUZZ
@given(st.lists(_TOKENS, max_size=60).map("".join))
@example("!!int ")  # found by this test: PyYAML's int constructor indexes an empty value (IndexError)
@example("a: !!binary ]x\n")
def test_yaml_ish_text_never_raises_anything_else(text: str) -> None:
    _answers(text)


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text_never_raises_anything_else(text: str) -> None:
    _answers(text)


@FUZZ
@given(st.integers(0, len(BASE_TEXT)), st.text(min_size=1, max_size=20))
def test_valid_file_with_an_insertion_still_answers(pos: int, insert: str) -> None:
    _answers(BASE_TEXT[:pos] + insert + BASE_TEXT[pos:])


# structured topologies: the valid base (or the seed) with some field replaced by an arbitrary value
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=30),
                     st.sampled_from(["cpu", "B200", "H100", "RTX-9090", "fp8", "bf16", "auto", "fp8_ds_mla", "/abs", "rel", "tcp", "nixl",
                                      "mooncake", "deepseek_v3", "llama", "glm5", "zai-org/GLM-5.1-FP8", "deepseek-ai/DeepSeek-V3",
                                      "meta-llama/Meta-Llama-3-70B", "10.1.0.2", "127.0.0.1"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                       max_leaves=6)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = value
    return doc


@st.composite
def _mutated(draw: st.DrawFn) -> str:
    doc = copy.deepcopy(draw(st.sampled_from([BASE, SEED])))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        if draw(st.booleans()) and path and isinstance(doc, dict):
            parent = doc
            for part in path[:-1]:
                parent = parent[part] if isinstance(parent, (dict, list)) else parent
            if isinstance(parent, dict) and path[-1] in parent:
                del parent[path[-1]]
                continue
        doc = _set(doc, path, draw(_VALUES))
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


@FUZZ
@given(_mutated())
def test_structured_topologies_never_raise_anything_else(text: str) -> None:
    _answers(text)


@settings(max_examples=15, deadline=5000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], derandomize=True)
@given(_mutated())
def test_validate_exits_0_3_or_4(tmp_path_factory: Any, text: str) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "t.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["validate", str(path), "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 3, 4), result.output
