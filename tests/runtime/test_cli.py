"""`tilepd decode-server` refuses bad input with the documented exit codes, naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tilepd.cli.app import app
from tilepd.contracts.exit_codes import ExitCode

runner = CliRunner()


def test_missing_config_file(tmp_path: Path) -> None:
    r = runner.invoke(app, ["decode-server", "--config", str(tmp_path / "nope.json")])
    assert r.exit_code == ExitCode.INPUT and "not found" in r.output


def test_invalid_config_names_the_field(tmp_path: Path) -> None:
    cfg = tmp_path / "decode.json"
    cfg.write_text(json.dumps({"name": "d", "served_model_name": "m", "family": "llama", "weights_dir": "/w", "max_seq_len": -1,
                               "advertise_host": "h", "http_port": 1, "ctrl_port": 2, "transport": {"name": "tcp"}}))
    r = runner.invoke(app, ["decode-server", "--config", str(cfg)])
    assert r.exit_code == ExitCode.INPUT and "max_seq_len" in r.output and str(cfg) in r.output


def test_needs_config_or_weights() -> None:
    r = runner.invoke(app, ["decode-server"])
    assert r.exit_code == ExitCode.USAGE and "--config" in r.output


def test_unloadable_weights_exit_with_input_code(tmp_path: Path) -> None:
    r = runner.invoke(app, ["decode-server", "--weights", str(tmp_path), "--http-port", "0", "--ctrl-port", "0"])
    assert r.exit_code == ExitCode.INPUT, r.output
    assert "cannot load the llama engine" in r.output and str(tmp_path) in r.output
