"""The API's error shape ``{"error": {type, message, field, line}}`` and its handlers; under the OpenAI-shaped
routes (`OPENAI_PREFIXES`) OpenAI's ``{"error": {message, type, param, code}}``, so its SDK raises its own
exception classes with ``param`` set."""

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


#: Paths answered with OpenAI's error shape. Under /v1/fine_tuning and /v1/webhook_endpoints the body is OpenAI's
#: (a 422 is a 400, as OpenAI answers a bad parameter); /v1/files keeps its own status codes and fields and adds
#: ``param``/``code``.
OPENAI_ROUTES = ("/v1/fine_tuning", "/v1/webhook_endpoints")
FILE_ROUTES = "/v1/files"


def openai_body(status: int, type_: str, message: str, field: str | None) -> dict[str, Any]:
    """OpenAI's error object: ``type`` its class of error, ``code`` ours (e.g. ``invalid_hyperparameters``)."""
    kind = {401: "authentication_error", 403: "permission_denied_error", 404: "invalid_request_error"}.get(status)
    if kind is None:
        kind = "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": field, "code": type_}}


def respond(
    request: Request,
    status: int,
    type_: str,
    message: str,
    field: str | None = None,
    line: int | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error in the shape of the route that answers it."""
    path = request.url.path
    if path.startswith(OPENAI_ROUTES):
        return JSONResponse(
            openai_body(status, type_, message, field), 400 if status == 422 else status, headers=headers
        )
    content = body(type_, message, field, line)
    if path.startswith(FILE_ROUTES):
        content["error"].update(param=field, code=type_)
    return JSONResponse(content, status, headers=headers)


def not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} {ident} not found")


def _loc(loc: Sequence[str | int]) -> str:
    """Pydantic's location as the dotted path the other errors use: ``("body", "stop", 0)`` -> ``stop[0]``."""
    out = ""
    for part in loc:
        if part in ("body", "query", "path", "header"):
            continue
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".") or "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return respond(request, exc.status, exc.type, exc.message, exc.field, exc.line, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        field = _loc(err.get("loc", ()))
        return respond(request, 422, "invalid_request", f"{field}: {err.get('msg')}", field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(
            request,
            exc.status_code,
            getattr(exc, "error_type", "http_error"),
            str(exc.detail),
            getattr(exc, "field", None),
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(BadKey)
    async def _bad_key(
        request: Request, exc: BadKey
    ) -> JSONResponse:  # a stored key that would leave its prefix: never served
        return respond(request, 404, "not_found", "stored object not found")

    @app.exception_handler(OperationalError)
    async def _db_down(request: Request, exc: OperationalError) -> JSONResponse:
        message = "the database is unreachable; retry shortly"
        return respond(request, 503, "unavailable", message, headers={"Retry-After": "5"})
