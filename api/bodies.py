"""Strict JSON request bodies: bounded nesting (checked before any recursive parse), finite numbers,
bounded integers, valid Unicode; a 422 naming the field, as FastAPI answers any other body it cannot
use. Routers with JSON bodies use ``StrictJsonRoute``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from gspo_core.data import JsonValueError, loads_strict


class BadJsonBody(HTTPException):
    """Raised from the body parse. An HTTPException so that FastAPI passes it on as it is (it turns any
    other exception there into a 400 without a field)."""

    error_type = "invalid_json"

    def __init__(self, message: str, field: str) -> None:
        super().__init__(422, message)
        self.field = field


class StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = loads_strict(body)
            except JsonValueError as exc:
                field = exc.path or "body"
                raise BadJsonBody(f"{field}: {exc.message}", field) from None
            except UnicodeDecodeError as exc:
                raise BadJsonBody(f"body: not valid UTF-8 (byte {exc.start})", "body") from None
            except ValueError as exc:
                if isinstance(exc, json.JSONDecodeError):
                    raise  # FastAPI's own 422 with the position
                raise BadJsonBody(f"body: {exc}", "body") from None
        return self._json


class StrictJsonRoute(APIRoute):
    """FastAPI's documented custom-route hook: the handler gets a :class:`StrictJsonRequest`."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict_handler
