"""A bad --out is a message naming the path and exit 2 (ExitCode.USAGE), never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tilepd.cli.app import build_app
from tilepd.contracts.exit_codes import ExitCode
from tilepd.resources import examples_dir

LOCAL = str(examples_dir() / "local.yaml")


def run(module: str, *args: str):  # noqa: ANN201 - click's Result
    return CliRunner().invoke(build_app([module]), list(args))


def check(result, *names: str) -> None:  # noqa: ANN001
    assert result.exit_code == int(ExitCode.USAGE), (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output and not isinstance(result.exception, (OSError, ValueError)), result.output
    for name in names:
        assert name in result.output, result.output


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a Linux /proc (a folder no one can create files in)")
def test_render_into_proc() -> None:
    check(run("tilepd.cli.topology_cmds", "render", LOCAL, "--out", "/proc/nope"), "/proc/nope", "cannot write")


def test_render_onto_an_existing_file(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("mine\n")
    check(run("tilepd.cli.topology_cmds", "render", LOCAL, "--out", str(f)), str(f), "not a directory")
    assert f.read_text() == "mine\n"  # untouched


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0555 folder anyway")
def test_render_into_a_read_only_folder(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    check(run("tilepd.cli.topology_cmds", "render", LOCAL, "--out", str(ro / "render")), str(ro / "render"))


def test_render_into_a_foreign_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "photo.jpg").write_bytes(b"x")
    check(run("tilepd.cli.topology_cmds", "render", LOCAL, "--out", str(tmp_path)), str(tmp_path), "no plan.json")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a Linux /proc (a folder no one can create files in)")
def test_convert_weights_into_proc(tmp_path: Path) -> None:
    import json

    from tilepd.dev.tiny_model import tiny_config

    # a real tiny-llama config.json: enough for convert-weights to read the options and reach its output folder
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama")))
    check(run("tilepd.cli.engine_cmds", "convert-weights", "--model-dir", str(tmp_path), "--out", "/proc/nope"), "/proc/nope", "cannot write")


def test_convert_weights_onto_an_existing_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"keep")
    check(run("tilepd.cli.engine_cmds", "convert-weights", "--model-dir", str(tmp_path), "--out", str(f)), str(f), "not a directory")
    assert f.read_bytes() == b"keep"
