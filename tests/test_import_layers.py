"""The processes below the planner load none of it: a vLLM worker (the connector), the router and a transport import
the contracts they share with the planner (tilepd.contracts), not tilepd.plan, the topology validator, the CLI or
ruamel.yaml. Each import runs in a fresh interpreter, so what another test imported cannot hide or cause a finding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = ("tilepd.plan", "tilepd.topology", "tilepd.cli", "ruamel")
# the router process is `python -m tilepd.router` (its __main__ imports the server, which imports the app lazily)
PROCESS_MODULES = ("tilepd.connector.vllm_connector", "tilepd.router", "tilepd.router.__main__", "tilepd.router.app",
                   "tilepd.transport")


def _loaded_after_import(module: str) -> list[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"import {module} failed: {out.stderr[-2000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", PROCESS_MODULES)
def test_process_module_loads_no_planner(module: str) -> None:
    loaded = _loaded_after_import(module)
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"import {module} loads {', '.join(bad[:12])}{' ...' if len(bad) > 12 else ''}"


def test_contracts_import_nothing_of_tilepd() -> None:
    modules = ("tilepd.contracts.service_configs", "tilepd.contracts.exit_codes", "tilepd.contracts.decode_http",
               "tilepd.contracts.marker", "tilepd.contracts.cpu_bind", "tilepd.contracts.config_file", "tilepd.contracts.logging_setup")
    loaded = _loaded_after_import("; import ".join(modules))
    bad = [m for m in loaded if m.startswith("tilepd.") and not m.startswith("tilepd.contracts")]
    assert not bad, f"tilepd.contracts loads {', '.join(bad)}"
