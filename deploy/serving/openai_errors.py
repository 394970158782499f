"""OpenAI-style error answers: every 4xx and 5xx of the ingress has this body shape."""

from __future__ import annotations

from typing import NoReturn

from fastapi.responses import JSONResponse
from pydantic import BaseModel

__all__ = ["APIError", "ErrorDetail", "ErrorResponse", "bad_request"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class APIError(Exception):
    """An error answered to the client as an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, code=code, param=param)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(ErrorResponse(error=self.detail).model_dump(), self.status, headers)


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> NoReturn:
    raise APIError(400, message, code=code, param=param)
