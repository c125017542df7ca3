"""The API key of a deployment's vLLM servers (prefill, native decode), kept out of argv, env and rendered files.

vLLM takes its key from `--api-key` (world-readable in /proc/PID/cmdline) or VLLM_API_KEY (in the unit's
environment, its env file, the spec). Instead the plan starts vLLM with `--middleware
tilepd.connector.vllm_auth.DeploymentApiKey` and names only the secret *file* in TILEPD_VLLM_SECRET_FILE (a path);
the middleware reads the deployment secret (0600) when vLLM builds its app and derives the key
(tilepd.auth.vllm_api_key), so the key lives only in the server's memory. A file that is missing or readable by
others stops vLLM at start with the reason (fail closed, never an open server).

Every path needs the key except the probes the supervisor, `tilepd status` and `doctor` read (/health, /ping,
/version, /metrics): stricter than vLLM's own key, which guards only /v1-like prefixes (so /tokenize, /pooling
and the dev endpoints stay open there).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

from tilepd.auth import load_secret, vllm_api_key

SECRET_FILE_ENV = "TILEPD_VLLM_SECRET_FILE"
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class DeploymentApiKey:
    """Pure ASGI middleware: `Authorization: Bearer <vllm_api_key(secret)>` on every path but OPEN_PATHS."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        path = os.environ.get(SECRET_FILE_ENV)
        if not path:
            raise RuntimeError(f"{SECRET_FILE_ENV} is not set: the tilepd API-key middleware needs the deployment secret file")
        self.app = app
        self._digest = hashlib.sha256(vllm_api_key(load_secret(Path(path))).encode()).digest()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, key = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(key.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if path in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return None
        body = json.dumps({"error": "Unauthorized: this vLLM takes requests from the tilepd router only"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
        return None
