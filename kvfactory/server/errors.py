"""Errors as the OpenAI API answers them: ``{"error": {"message", "type", "param", "code"}}``.

``param`` names the request field at fault (dotted for nested ones: ``messages.0.role``), so a
client can point at it. Request bodies that do not parse or validate are 400s here, where FastAPI
would answer 422: OpenAI's clients expect 400 for every invalid request. Every rejected request
(4xx, and 503 for a full queue or a stopping server) is counted by status and reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

INVALID = "invalid_request_error"
SERVER = "server_error"


class APIError(Exception):
    """An error response: ``status``, its message, the field at fault and extra headers. ``reason``
    labels a rejected request in ``kvfactory_requests_rejected_total`` (None: not a rejection, such
    as a request that ran and failed, counted among finished requests)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = INVALID,
                 headers: dict[str, str] | None = None, reason: str | None = "invalid") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers, self.reason = headers or {}, reason


def error_body(message: str, kind: str = INVALID, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def install_error_handlers(app: FastAPI, rejected: Callable[[int, str], None]) -> None:
    """Answer errors in OpenAI's shape; ``rejected(status, reason)`` counts each rejected request."""

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.reason is not None:
            rejected(exc.status, exc.reason)
        return JSONResponse(error_body(exc.message, exc.kind, exc.param), exc.status, headers=exc.headers)

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        rejected(400, "invalid")
        error = exc.errors()[0]
        if error.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the body is not valid JSON: {error.get('msg')}"), 400)
        location = [str(part) for part in error.get("loc", ())[1:]]  # after "body"
        param = ".".join(location) or None
        message = f"{param}: {error.get('msg')}" if param else f"the body: {error.get('msg')}"
        return JSONResponse(error_body(message, INVALID, param), 400)

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        rejected(exc.status_code, "route")
        kind = SERVER if exc.status_code >= 500 else INVALID
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
