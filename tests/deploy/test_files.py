"""files.apply: one-step, idempotent, check-mode-honest writes of a host's rendered files."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

from tilepd.deploy.files import apply


def _manifest(root: Path, content: str = '{"a": 1}\n', mode: str = "0644") -> dict:
    return {"dirs": [str(root / "logs")], "files": [{"path": str(root / "config" / "x.json"), "content": content, "mode": mode}]}


def test_apply_writes_once_then_reports_unchanged(tmp_path: Path) -> None:
    first = apply(_manifest(tmp_path))
    assert first["changed"] and first["written"] == [str(tmp_path / "config" / "x.json")] and (tmp_path / "logs").is_dir()
    assert apply(_manifest(tmp_path)) == {"changed": False, "dirs_created": [], "written": []}


def test_check_mode_reports_but_writes_nothing(tmp_path: Path) -> None:
    apply(_manifest(tmp_path))
    res = apply(_manifest(tmp_path, content='{"a": 2}\n'), check=True)
    assert res["changed"] and (tmp_path / "config" / "x.json").read_text() == '{"a": 1}\n'
    fresh = tmp_path / "fresh"
    assert apply(_manifest(fresh), check=True)["changed"] and not fresh.exists()


def test_mode_change_alone_rewrites(tmp_path: Path) -> None:
    apply(_manifest(tmp_path))
    assert apply(_manifest(tmp_path, mode="0600"))["changed"]
    assert stat.S_IMODE((tmp_path / "config" / "x.json").stat().st_mode) == 0o600


def test_cli_reads_the_manifest_from_stdin(tmp_path: Path) -> None:
    run = lambda *a: subprocess.run([sys.executable, "-m", "tilepd.deploy.files", "apply", *a], input=json.dumps(_manifest(tmp_path)), capture_output=True, text=True, timeout=60)  # noqa: E731
    assert json.loads(run("--check").stdout)["changed"] and not (tmp_path / "config").exists()
    assert json.loads(run().stdout)["changed"]
    assert json.loads(run().stdout)["changed"] is False
    bad = subprocess.run([sys.executable, "-m", "tilepd.deploy.files", "apply"], input="not json", capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and json.loads(bad.stdout)["failed"]
