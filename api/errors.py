"""The API's one error shape ``{"error": {type, message, field, line}}`` and its handlers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.schemas import ErrorBody, ErrorDetail
from store.objects import BadKey


class ApiError(Exception):
    """Raise from anywhere in a request: becomes ``status`` with the error body."""

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        field: str | None = None,
        line: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status, self.type, self.message, self.field, self.line = status, type_, message, field, line
        self.headers = headers
        super().__init__(message)


def body(type_: str, message: str, field: str | None = None, line: int | None = None) -> dict[str, Any]:
    """The error body (:class:`ErrorBody`) as JSON-ready data."""
    return ErrorBody(error=ErrorDetail(type=type_, message=message, field=field, line=line)).model_dump()


def not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} {ident} not found")


def _loc(loc: Sequence[str | int]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(body(exc.type, exc.message, exc.field, exc.line), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        field = _loc(err.get("loc", ()))
        return JSONResponse(body("invalid_request", f"{field}: {err.get('msg')}", field), 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            body(getattr(exc, "error_type", "http_error"), str(exc.detail), getattr(exc, "field", None)),
            exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(BadKey)
    async def _bad_key(
        _: Request, exc: BadKey
    ) -> JSONResponse:  # a stored key that would leave its prefix: never served
        return JSONResponse(body("not_found", "stored object not found"), 404)

    @app.exception_handler(OperationalError)
    async def _db_down(_: Request, exc: OperationalError) -> JSONResponse:
        return JSONResponse(
            body("unavailable", "the database is unreachable; retry shortly"), 503, headers={"Retry-After": "5"}
        )
