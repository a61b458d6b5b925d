"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause or meet ends up here: bad JSON, wrong fields, an unknown
model or route, an oversized body, a full queue, a server that is shutting down.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A request that cannot be served; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def install_handlers(app: FastAPI) -> None:
    """Answer every error, ours and the framework's, in OpenAI's format."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}
        error = APIError(e.status_code, message.get(e.status_code, str(e.detail)))
        return JSONResponse(error.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(e).__name__}: {e}").response()
