"""Bounded input: alias bombs, merge-key bombs, recursion and oversized files answer fast with a located error."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

from tilepd.topology import TopologyFileError, load_topology, load_topology_text
from tilepd.topology.yaml_source import MAX_ALIAS_VALUES, MAX_BYTES, MAX_DEPTH, MAX_VALUES, parse_yaml

BASE = (Path(__file__).parent / "base_valid.yaml").read_text()


def _laughs(levels: int = 9) -> str:
    """The classic billion-laughs file: 9 levels of 9 aliases = 9**9 strings, under 1 KB of text."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _merge_bomb(levels: int = 8) -> str:
    lines = ["m0: &m0 {x: 1}"]
    lines += [f"m{i}: &m{i} {{<<: [{','.join([f'*m{i - 1}'] * 10)}]}}" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text", [_laughs(), _merge_bomb()], ids=["billion-laughs", "merge-keys"])
def test_alias_bomb_is_refused_before_it_expands(text: str) -> None:
    """The proof is the bound's own message and flat memory; the CPU-time ceiling only catches a hang (unbounded,
    these 1 KB files took over 30 s and 13 GB), so it is this process's CPU seconds, not wall time, and generous."""
    assert len(text.encode()) < 1100
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    with pytest.raises(TopologyFileError) as info:
        load_topology_text(text, "bomb.yaml")
    assert time.process_time() - start < 10.0
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) < 200_000  # KB: no blow-up
    assert f"YAML aliases expand to more than {MAX_ALIAS_VALUES} values" in str(info.value)
    assert info.value.line >= 1 and info.value.col >= 1
    assert str(info.value).startswith(f"bomb.yaml:{info.value.line}:{info.value.col}: ")


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "a: &a {<<: *a}\n", "a: &a {b: *a}\n"], ids=["list", "merge", "mapping"])
def test_recursive_alias_is_refused_by_depth(text: str) -> None:
    with pytest.raises(TopologyFileError, match=f"nested deeper than {MAX_DEPTH} levels") as info:
        load_topology_text(text, "rec.yaml")
    assert (info.value.line, info.value.col) == (1, 4)


def test_oversized_file_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * MAX_BYTES + "\n" + BASE)
    with pytest.raises(TopologyFileError, match=f"larger than a topology file may be \\({MAX_BYTES} bytes\\)"):
        load_topology(big)
    with pytest.raises(TopologyFileError, match="larger than a topology file may be"):
        load_topology_text(big.read_text(), str(big))
    start = time.process_time()
    with pytest.raises(TopologyFileError, match="larger than"):
        load_topology("/dev/zero")  # endless: only MAX_BYTES + 1 are read (reading it whole would never end)
    assert time.process_time() - start < 10.0


def test_merge_keys_keep_yaml_semantics_and_positions() -> None:
    text = "base: &base {x: 1, y: 2}\nother: &other {y: 9, z: 3}\nm:\n  <<: [*base, *other]\n  y: 5\n"
    data, smap = parse_yaml(text, "m.yaml")
    assert data["m"] == {"x": 1, "y": 5, "z": 3}  # own keys win; of the merged, the first listed wins
    assert smap.position(("m", "y")) == (5, 6)
    assert smap.position(("m", "x")) == (1, 17)  # a merged value points where it is written


def test_aliases_within_the_bound_still_work() -> None:
    text = BASE.replace('    extra_args: ["--max-num-seqs", "64"]\n', '    extra_args: &xa ["--max-num-seqs", "64"]\n')
    text = text.replace("    port: 8100\n", "    port: 8100\n    extra_args: *xa\n")
    assert load_topology_text(text, "ok.yaml").native_decode[0].extra_args == ["--max-num-seqs", "64"]


def test_scalar_the_constructor_rejects_is_a_located_error() -> None:
    with pytest.raises(TopologyFileError, match="'2001-13-45' cannot be read as timestamp") as info:
        load_topology_text(BASE.replace("  name: fixture\n", "  name: fixture\n  when: 2001-13-45\n"), "t.yaml")
    assert (info.value.line, info.value.col) == (4, 9)


def test_many_values_without_aliases_are_bounded_too() -> None:
    text = "x: [" + ",".join(["1"] * (MAX_VALUES + 1)) + "]\n"
    with pytest.raises(TopologyFileError, match=f"more than {MAX_VALUES} values"):
        load_topology_text(text, "wide.yaml")
