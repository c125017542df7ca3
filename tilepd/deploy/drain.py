"""Drain and undrain a decode node through its admin API, and wait until it is idle.

A draining node finishes the request that holds its slot and refuses new ones (HTTP 503
`draining`; the router leases it no more once its health check or a refusal says so).
Once it is draining and idle nothing new can start on it, so idle is final: it can be
restarted or stopped without dropping a request. Used by `tilepd drain` (controller side)
and by `python -m tilepd.deploy.proc start` when it restarts a running decode node (host side).

The admin calls carry the node API key derived from the deployment secret (tilepd.auth).
Only httpx is imported: operator verbs stay free of torch and vLLM.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import httpx

from tilepd.auth import MIN_SECRET_CHARS, SecretFileError, load_secret, node_auth_header

POLL_S = 0.2
CALL_TIMEOUT_S = 5.0
DEPLOYMENT_SECRET_ENV = "TILEPD_DEPLOYMENT_SECRET"  # tilepd.plan.builder's name for the same variable


class DrainError(Exception):
    """The node could not be asked: `unreachable` (no answer), `unauthorized` (wrong key), `unsupported` (an older
    tilepd without the admin API), `bad_answer` (anything else)."""

    def __init__(self, kind: Literal["unreachable", "unauthorized", "unsupported", "bad_answer"], message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class DrainResult:
    node: str
    url: str
    draining: bool
    idle: bool
    state: str
    transfer_id: str | None
    waited_s: float

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _call(method: str, url: str, headers: Mapping[str, str], node: str) -> dict[str, Any]:
    try:
        r = httpx.request(method, url, headers=dict(headers), timeout=CALL_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise DrainError("unreachable", f"decode node {node} at {url}: {type(exc).__name__}: {exc}") from None
    if r.status_code == 401:
        raise DrainError("unauthorized", f"decode node {node} refused the node API key ({url} answered 401): the deployment "
                         f"secret used here is not the one the node started with")
    if r.status_code in (404, 405):
        raise DrainError("unsupported", f"decode node {node} has no admin API ({url} answered {r.status_code}): it runs a "
                         "tilepd older than drain; restart it to upgrade")
    if r.status_code != 200:
        raise DrainError("bad_answer", f"decode node {node}: {url} answered {r.status_code}: {r.text[:300]}")
    try:
        body = r.json()
    except ValueError:
        raise DrainError("bad_answer", f"decode node {node}: {url} answered 200 with a body that is not JSON") from None
    if not isinstance(body, dict):
        raise DrainError("bad_answer", f"decode node {node}: {url} answered 200 with {type(body).__name__}, not an object")
    return body


def _result(node: str, base: str, body: dict[str, Any], waited_s: float) -> DrainResult:
    busy = bool(body.get("busy")) if "busy" in body else not bool(body.get("idle"))
    return DrainResult(node, base, bool(body.get("draining")), not busy, str(body.get("state") or "?"), body.get("transfer_id"),
                       round(waited_s, 3))


def drain(base_url: str, secret: bytes | None, *, timeout_s: float, node: str = "", poll_s: float = POLL_S) -> DrainResult:
    """Start draining, then wait until the node is idle or `timeout_s` passes (the node stays draining either way)."""
    base = base_url.rstrip("/")
    headers = node_auth_header(secret)
    t0 = time.monotonic()
    body = _call("POST", f"{base}/admin/drain", headers, node)
    result = _result(node, base, body, 0.0)
    while not result.idle and time.monotonic() - t0 < timeout_s:
        time.sleep(poll_s)
        try:
            body = _call("GET", f"{base}/status", {}, node)
        except DrainError as exc:
            if exc.kind != "unreachable" or time.monotonic() - t0 >= timeout_s:
                raise
            continue  # a busy node may answer slowly: keep asking until the timeout
        result = _result(node, base, body, time.monotonic() - t0)
    result.waited_s = round(time.monotonic() - t0, 3)
    return result


def undrain(base_url: str, secret: bytes | None, *, node: str = "") -> DrainResult:
    """Take new requests again (the router leases the node after its next health check)."""
    base = base_url.rstrip("/")
    return _result(node, base, _call("POST", f"{base}/admin/undrain", node_auth_header(secret), node), 0.0)


def env_secret(problem: str, environ: Mapping[str, str] | None = None) -> bytes:
    """`$TILEPD_DEPLOYMENT_SECRET` when the node's secret file could not be read (`problem` says why), else SecretFileError."""
    value = (os.environ if environ is None else environ).get(DEPLOYMENT_SECRET_ENV, "").strip()
    if len(value) >= MIN_SECRET_CHARS:
        return value.encode()
    raise SecretFileError(f"{problem}; nor is ${DEPLOYMENT_SECRET_ENV} set to the deployment secret")


def secret_from(path: Path | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment secret for a node's admin calls: its secret file, else `$TILEPD_DEPLOYMENT_SECRET`; None when the
    node runs without one (an unauthenticated dev run). Raises SecretFileError naming both when neither is usable."""
    if path is None:
        return None
    try:
        return load_secret(path)
    except SecretFileError as exc:
        return env_secret(str(exc), environ)
