"""The lazy verb table of `tilepd.cli.app` matches what each module registers, and a verb's
process imports only its own module."""

from __future__ import annotations

import subprocess
import sys

import typer.main

from tilepd.cli.app import VERB_MODULES, build_app, verb_of


def _verbs(app) -> set[str]:
    return set(typer.main.get_command(app).commands)


def test_every_module_registers_exactly_its_verbs() -> None:
    for module in set(VERB_MODULES.values()):
        assert _verbs(build_app([module])) == {v for v, m in VERB_MODULES.items() if m == module}, module
    assert _verbs(build_app()) == set(VERB_MODULES)


def test_verb_of_skips_root_options() -> None:
    assert verb_of(["--version"]) is None
    assert verb_of(["plan", "x.yaml", "--json"]) == "plan"
    assert verb_of(["--help"]) is None
    assert verb_of([]) is None


def test_plan_process_does_not_import_other_verbs(tmp_path) -> None:
    code = ("import sys; from tilepd.cli.app import main\n"
            "try:\n    main(['plan', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('tilepd.cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    assert "tilepd.cli.topology_cmds" in out
    for other in ("deploy_cmds", "engine_cmds", "runtime_cmds", "router_cmds"):
        assert other not in out, out


def test_unknown_verb_still_suggests_from_every_verb() -> None:
    r = subprocess.run([sys.executable, "-m", "tilepd", "stauts"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "status" in r.stderr
