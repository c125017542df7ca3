"""Check `vllm-version`: the vLLM on a prefill or native-decode interpreter is one TilePDConnector supports.

The connector refuses any other release at startup (tilepd.connector.vllm_version); this finds
it before `up`, from the version the host's interpreter reports (package metadata, no import).
"""

from __future__ import annotations

from tilepd.connector.vllm_version import SUPPORTED_RANGE, TESTED, problem
from tilepd.doctor.result import Finding, ok


def evaluate_vllm_version(host: str, python: str, version: str) -> Finding:
    """ok when `version` is in the supported range, else a required failure naming both."""
    if problem("vllm", version) is None:
        return ok("vllm-version", host, f"vLLM {version} in {python} (supported {SUPPORTED_RANGE})")
    return Finding(
        "vllm-version", host, "fail",
        f"vLLM {version} in {python}; TilePDConnector supports {SUPPORTED_RANGE} (tested: {', '.join(TESTED)}) and refuses it at startup",
        f"{python} -m pip install 'tilepd[prefill]' (GPU) or 'tilepd[prefill-cpu]' (CPU): both pin the supported range",
        "RB-upgrade",
    )
