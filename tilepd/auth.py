"""The deployment secret and what is derived from it: only the router may drive a decode node.

`tilepd up` places one random secret per deployment on every host (mode 0600, a file
named by `secret_file` in the router's and the decode nodes' configs). The router mints
each request's transfer token as HMAC-SHA256(secret, "tilepd-transfer:" + transfer_id),
so a decode node checks a token without keeping state and a stranger cannot invent a
valid (transfer id, token) pair; the connector only carries the token the router gave it.
Mutating calls on a decode node also carry `Authorization: Bearer HMAC(secret, "tilepd-node-api")`.

This module is the one place that derives them (router and decode node both import it);
it imports neither torch nor vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import stat
from pathlib import Path

TRANSFER_LABEL = "tilepd-transfer:"
# transfer ids of a rolling restart's canary (tilepd/deploy/canary.py): the one request a draining decode node takes,
# so a restarted node is tried end to end before the router leases it; its token is minted like any other
CANARY_TRANSFER_PREFIX = "canary-"
NODE_API_LABEL = "tilepd-node-api"
VLLM_API_LABEL = "tilepd-vllm-api"
SECRET_BYTES = 32  # 64 hex characters
MIN_SECRET_CHARS = 32


class SecretFileError(OSError):
    """The configured secret file is missing, empty, too short or readable by others."""


def new_secret() -> str:
    """A fresh deployment secret (hex, so it travels through environments and files unchanged)."""
    return secrets.token_hex(SECRET_BYTES)


def load_secret(path: Path) -> bytes:
    """Read a secret file; refuse one that group or others may read (like ssh does with keys)."""
    path = Path(path)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        value = path.read_text().strip()
    except OSError as exc:
        raise SecretFileError(f"secret_file {path}: {exc.strerror or exc}") from exc
    if mode & 0o077:
        raise SecretFileError(f"secret_file {path}: mode {mode:04o} lets others read it; chmod 600 {path}")
    if len(value) < MIN_SECRET_CHARS:
        raise SecretFileError(f"secret_file {path}: holds {len(value)} characters, at least {MIN_SECRET_CHARS} needed")
    return value.encode()


def _mac(secret: bytes, message: str) -> str:
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def transfer_token(secret: bytes, transfer_id: str) -> str:
    """The token of one transfer: the router puts it in the marker and the decode request."""
    return _mac(secret, TRANSFER_LABEL + transfer_id)


def node_api_key(secret: bytes) -> str:
    """The bearer key of a decode node's mutating endpoints."""
    return _mac(secret, NODE_API_LABEL)


def vllm_api_key(secret: bytes) -> str:
    """The bearer key every vLLM the deployment starts (prefill, native decode) requires (tilepd.connector.vllm_auth)."""
    return _mac(secret, VLLM_API_LABEL)


def vllm_auth_header(secret: bytes | None) -> dict[str, str]:
    """Headers of a call on a deployment's vLLM ({} without a secret: an unauthenticated dev run)."""
    return {"Authorization": f"Bearer {vllm_api_key(secret)}"} if secret else {}


def node_auth_header(secret: bytes | None) -> dict[str, str]:
    """Headers for a mutating call on a decode node ({} without a secret: an unauthenticated dev run)."""
    return {"Authorization": f"Bearer {node_api_key(secret)}"} if secret else {}


def transfer_token_ok(secret: bytes, transfer_id: str, token: str) -> bool:
    return hmac.compare_digest(transfer_token(secret, transfer_id).encode(), token.encode())


def bearer_ok(secret: bytes, authorization: str | None) -> bool:
    """True when `authorization` is `Bearer <node_api_key(secret)>` (constant-time compare)."""
    presented = ""
    if authorization and authorization[:7].lower() == "bearer ":
        presented = authorization[7:].strip()
    return hmac.compare_digest(node_api_key(secret).encode(), presented.encode())
