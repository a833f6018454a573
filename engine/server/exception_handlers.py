"""The engine server's exception handlers: every error a route raises, and the framework's own (unknown path,
wrong method, a body that cannot be parsed), answered in OpenAI's error shape."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvgate.common.errors import EngineError, InvalidRequestError
from kvgate.engine.server.openai_serving import ModelNotFound, Overloaded, ShuttingDown
from kvgate.engine.server.protocol import error_body
from kvgate.engine.server.responses import error_response

log = logging.getLogger(__name__)


async def validation_error(_: Request, exc: RequestValidationError):
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, "The request body is not valid JSON.", "invalid_request_error")
    where = ".".join(loc) or "body"
    return error_response(400, f"Invalid request: {where}: {first.get('msg', 'invalid value')}",
                          "invalid_request_error", loc[0] if loc else None)


async def invalid_request(_: Request, exc: InvalidRequestError):
    return error_response(400, str(exc), "invalid_request_error", exc.param)


async def model_not_found(_: Request, exc: ModelNotFound):
    return error_response(404, str(exc), "not_found_error", "model")


async def overloaded(_: Request, exc: Overloaded):
    return error_response(503, str(exc), "overloaded_error")


async def shutting_down(_: Request, exc: ShuttingDown):
    return error_response(503, str(exc), "server_error")


async def http_error(_: Request, exc: StarletteHTTPException):
    err_type = "not_found_error" if exc.status_code == 404 else (
        "invalid_request_error" if exc.status_code < 500 else "server_error")
    return JSONResponse(error_body(str(exc.detail), err_type, exc.status_code), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def engine_error(_: Request, exc: EngineError):
    return error_response(503, str(exc), "server_error")


async def unexpected(_: Request, exc: Exception):
    log.exception("unhandled error")
    return error_response(500, f"Internal server error ({type(exc).__name__}).", "server_error")


# (exception class, handler), in the order create_app adds them
EXCEPTION_HANDLERS = (
    (RequestValidationError, validation_error),
    (InvalidRequestError, invalid_request),
    (ModelNotFound, model_not_found),
    (Overloaded, overloaded),
    (ShuttingDown, shutting_down),
    (StarletteHTTPException, http_error),
    (EngineError, engine_error),
    (Exception, unexpected),
)
