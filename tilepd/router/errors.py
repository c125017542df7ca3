"""OpenAI-style errors: one exception type the HTTP layer turns into a JSON error body."""

from __future__ import annotations

from typing import Any


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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
