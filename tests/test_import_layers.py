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


# The packages from the bottom up (docs/INTERFACES.md, "Import direction"): a package imports only its own layer's
# and lower ones, imports written inside functions included.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer.split()) for layer in (
    "contracts model_format resources runbooks auth otel",  # leaves: import nothing of tilepd
    "transport",
    "control",
    "weights",  # the converter: the model's format (model_format) in, the runtime files out
    "engine dev",  # the engine reads those files (engine/weights_loader.py)
    "topology",
    "plan",
    "connector runtime router",  # the processes
    "deploy doctor capacity",  # the operator's tools
    "cli __main__",
))
# no import runs upward. A process entry point (`python -m tilepd.X`, a package's __main__.py) sits on top with the
# CLI, since nothing imports it: tilepd/runtime/__main__.py reaching into tilepd.cli.runtime_cmds (the `tilepd
# decode-server` verb: one definition of its flags) is such an entry point, not an import of tilepd.runtime's
UPWARD_ALLOWED: set[tuple[str, str]] = set()


def _package_imports() -> dict[tuple[str, str], list[str]]:
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "tilepd"
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        src = "__main__" if path.name == "__main__.py" else path.relative_to(root).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "tilepd" and len(parts) > 1 and parts[1] != src:
                    edges.setdefault((src, parts[1]), []).append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return edges


def _layer(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def test_every_package_has_a_layer() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "tilepd"
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()} | \
        {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    assert packages == set().union(*LAYERS), "a package is missing from LAYERS (and from docs/INTERFACES.md's map)"


def test_imports_run_downward() -> None:
    upward = {edge: where for edge, where in _package_imports().items() if _layer(edge[0]) < _layer(edge[1])}
    assert set(upward) == UPWARD_ALLOWED, {e: w for e, w in upward.items() if e not in UPWARD_ALLOWED}


def _cyclic(graph: dict[str, set[str]]) -> set[str]:
    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == b:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return {p for p in graph if reaches(p, p)}


def test_no_package_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for a, b in _package_imports():
        graph.setdefault(a, set()).add(b)
    assert not _cyclic(graph), {(a, b): w for (a, b), w in _package_imports().items() if a in _cyclic(graph) and b in _cyclic(graph)}


def _module_imports() -> dict[str, set[str]]:
    """Module -> the tilepd modules it imports (`from tilepd.x import y` counts as tilepd.x.y when y is a module)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "tilepd"
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
            else:
                continue
            graph.setdefault(mod, set()).update(n for n in names if n in modules and n != mod)
    return graph


def test_no_module_cycle() -> None:
    """Inside a package too: two modules that import each other (even lazily, inside a function) are one concern
    split in two or a piece that belongs below both."""
    graph = _module_imports()
    cyclic = _cyclic(graph)
    assert not cyclic, {m: sorted(graph[m] & cyclic) for m in sorted(cyclic)}


def test_model_format_imports_nothing_of_tilepd_and_its_spec_no_torch() -> None:
    """The operator's install (no torch) validates topologies through tilepd.model_format.model_spec."""
    loaded = _loaded_after_import("tilepd.model_format.model_spec")
    assert not [m for m in loaded if m.startswith("tilepd.") and not m.startswith("tilepd.model_format")], loaded
    assert "torch" not in loaded
    loaded = _loaded_after_import("tilepd.model_format.block_fp8")
    assert not [m for m in loaded if m.startswith("tilepd.") and not m.startswith("tilepd.model_format")]
