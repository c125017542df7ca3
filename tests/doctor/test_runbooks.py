"""The runbooks: each has its sections, every id the code names exists, every runbook is named by the code,
`tilepd runbook` lists and prints them, and the wheel carries them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tilepd.cli.app import build_app
from tilepd.doctor.runbooks import RUNBOOK_ID, all_runbooks, runbooks_dir

PKG = Path(__file__).resolve().parents[2] / "tilepd"
SECTIONS = ("## Symptoms", "## Diagnosis", "## Fix", "## Verify")


def _ids_in_code() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in PKG.rglob("*.py"):
        for m in RUNBOOK_ID.finditer(path.read_text()):
            found.setdefault(m.group(0), []).append(str(path.relative_to(PKG.parent)))
    return found


def test_each_runbook_has_an_id_title_and_sections() -> None:
    books = all_runbooks()
    assert len(books) >= 11
    for rb in books:
        text = rb.text()
        assert text.startswith(f"# {rb.id}: "), rb.path
        assert rb.title and rb.title != rb.id
        for section in SECTIONS:
            assert re.search(rf"^{section}", text, re.M), f"{rb.path}: no {section!r}"
        assert "```bash" in text, f"{rb.path}: no diagnosis commands"


def test_every_id_in_code_has_a_runbook_and_every_runbook_is_referenced() -> None:
    have = {rb.id for rb in all_runbooks()}
    used = _ids_in_code()
    assert set(used) - have == set(), {i: used[i] for i in set(used) - have}
    assert have - set(used) == set(), f"runbooks no message in tilepd/ names: {sorted(have - set(used))}"


def test_runbook_ids_in_runbooks_resolve() -> None:
    have = {rb.id for rb in all_runbooks()}
    for rb in all_runbooks():
        assert set(RUNBOOK_ID.findall(rb.text())) <= have, rb.path


def test_cli_lists_and_prints() -> None:
    app = build_app(["tilepd.cli.doctor_cmds"])
    runner = CliRunner()
    listing = runner.invoke(app, ["runbook"], env={"COLUMNS": "200"})
    assert listing.exit_code == 0
    for rb in all_runbooks():
        assert rb.id in listing.stdout
    shown = runner.invoke(app, ["runbook", "kv-timeout"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "RB-kv-timeout" in shown.stdout and "ibv_devinfo" in shown.stdout
    unknown = runner.invoke(app, ["runbook", "RB-nope"])
    assert unknown.exit_code == 2 and "RB-decode-down" in unknown.stderr


def test_operator_verbs_import_neither_torch_nor_vllm() -> None:
    code = ("import sys, tilepd.cli.doctor_cmds, tilepd.doctor.runner, tilepd.doctor.runbooks; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')); print(heavy); sys.exit(bool(heavy))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_pyproject_ships_the_runbooks_where_the_finder_looks() -> None:
    text = (PKG.parent / "pyproject.toml").read_text()
    assert '"docs/runbooks" = "tilepd/_bundled/runbooks"' in text
    assert runbooks_dir() == PKG.parent / "docs" / "runbooks"


@pytest.mark.slow
def test_wheel_carries_the_runbooks(tmp_path: Path) -> None:
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(PKG.parent)], check=True)
    (wheel,) = tmp_path.glob("tilepd-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path / "unpacked")
    assert {f"tilepd/_bundled/runbooks/{rb.path.name}" for rb in all_runbooks()} <= names
    r = subprocess.run([sys.executable, "-c", "from tilepd.doctor.runbooks import runbooks_dir, get; print(runbooks_dir()); print(get('RB-upgrade').title)"],
                       capture_output=True, text=True, cwd=tmp_path / "unpacked", env={"PYTHONPATH": str(tmp_path / "unpacked")})
    assert r.returncode == 0, r.stderr
    where, title = r.stdout.split("\n")[:2]
    assert Path(where).is_relative_to(tmp_path / "unpacked") and "upgrade" in title


def test_the_index_lists_every_runbook() -> None:
    index = (runbooks_dir() / "README.md").read_text()
    for rb in all_runbooks():
        assert f"[{rb.id}]({rb.path.name})" in index, rb.id
