"""Errors as the OpenAI API answers them: ``{"error": {"message", "type", "param", "code"}}``.

``param`` names the request field at fault (dotted for nested ones: ``messages.0.role``), so a
client can point at it. Request bodies that do not parse or validate are 400s here, where FastAPI
would answer 422: OpenAI's clients expect 400 for every invalid request.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

INVALID = "invalid_request_error"
SERVER = "server_error"


class APIError(Exception):
    """An error response: ``status``, its message, the field at fault and extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = INVALID,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}


def error_body(message: str, kind: str = INVALID, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.kind, exc.param), exc.status, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    error = exc.errors()[0]
    if error.get("type") == "json_invalid":
        return JSONResponse(error_body(f"the body is not valid JSON: {error.get('msg')}"), 400)
    location = [str(part) for part in error.get("loc", ())[1:]]  # after "body"
    param = ".".join(location) or None
    message = f"{param}: {error.get('msg')}" if param else f"the body: {error.get('msg')}"
    return JSONResponse(error_body(message, INVALID, param), 400)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = SERVER if exc.status_code >= 500 else INVALID
    return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)
