"""The decode node's error answers (INTERFACES §4): an HTTP status with `{"error": {code, message, param?}}`."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


def error_response(status: int, code: str, message: str, param: str | None = None, headers: dict | None = None,
                   extra: dict[str, Any] | None = None) -> JSONResponse:
    """`extra`: more fields of the error object (a refused reservation's `holder`)."""
    err: dict[str, Any] = {"code": code, "message": message}
    if param:
        err["param"] = param
    if extra:
        err.update(extra)
    return JSONResponse({"error": err}, status_code=status, headers=headers)


def unauthorized(message: str, code: str = "unauthorized") -> JSONResponse:
    return error_response(401, code, message, headers={"www-authenticate": "Bearer"})
