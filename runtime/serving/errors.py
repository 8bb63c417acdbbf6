"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    """A refused request; `message` says what to change."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


async def api_error_handler(_request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def validation_error_handler(_request: Request, error: RequestValidationError) -> JSONResponse:
    """The first problem pydantic found, named by its field (body.messages.0.role -> messages.0.role)."""
    problems = error.errors()
    if not problems:
        return await api_error_handler(_request, APIError("invalid request body"))
    first = problems[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('msg')}"
    elif first.get("type") == "missing":
        message = f"{param} is required"
    else:
        message = f"{param}: {first.get('msg')}, got {first.get('input')!r}" if param \
            else str(first.get("msg"))
    return await api_error_handler(_request, APIError(message, param=param))
