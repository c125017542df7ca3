"""OpenAI-style errors: one exception type the HTTP layer turns into a JSON error body.

An error of a failure mode an on-call runbook covers carries its id in the body's `runbook` field
(`tilepd runbook ID` prints it): by error code here, in one place, so no raise site has to remember it;
a relayed decode-node error whose message names a runbook (its slot errors do) passes that id on.
"""

from __future__ import annotations

import re
from typing import Any

from tilepd.runbooks import RUNBOOKS

# error code -> the runbook of that failure mode (codes of the router's own errors and of relayed decode-node errors)
RUNBOOK_BY_CODE: dict[str, str] = {
    "decode_pool_busy": "RB-router-429",
    "no_decode_node": "RB-decode-down",
    "node_faults": "RB-decode-down",
    "no_node_to_continue": "RB-decode-down",
    "unreachable": "RB-decode-down",  # a decode node that does not answer (DecodeNodeError status 0)
    "kv_timeout": "RB-kv-timeout",
    "prefill_unreachable": "RB-prefill-restarted",
    "native_decode_unreachable": "RB-native-fallback",
    "native_decode_broken": "RB-native-fallback",
    "native_prefill_bad_response": "RB-native-fallback",
}
_NAMED = re.compile(r"\(runbook (RB-[a-z0-9-]+):")  # tilepd.runbooks.see() in a relayed message


def runbook_for(code: str | None, message: str = "") -> str | None:
    """The runbook of an error: the one its (relayed) message names, the root cause's (a decode node's
    kv_timeout inside `node_faults`), else by its code, else None."""
    m = _NAMED.search(message)
    if m and m.group(1) in RUNBOOKS:
        return m.group(1)
    return RUNBOOK_BY_CODE.get(code or "")


class RouterError(Exception):
    """An error with the HTTP status and the OpenAI error fields a client expects."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        runbook: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.runbook = runbook or runbook_for(code, message)

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.runbook:
            err["runbook"] = self.runbook  # an extra field of the OpenAI error object: clients ignore it, operators read it
        return {"error": err}


class PassThroughError(Exception):
    """An upstream (vLLM) error relayed with its own status and body."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        super().__init__(f"upstream status {status}")
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers: dict[str, str] = {}


def unsupported(param: str, why: str) -> RouterError:
    """The low-latency engine cannot honour `param` and no native pool takes the request."""
    return RouterError(501, f"'{param}' is not supported by the low-latency pool: {why}", type="not_implemented", code="unsupported_parameter", param=param)


def invalid(param: str, why: str) -> RouterError:
    return RouterError(400, f"invalid '{param}': {why}", code="invalid_parameter", param=param)
