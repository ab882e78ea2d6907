"""treadle's errors -> HTTP status, in one place (the HTTP twin of
``server.rpc.interceptors``): the status of a refused request, and the
``{error, category}`` body of a future that failed."""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from treadle.errors import TreadleError
from treadle.server.db.outage import database_outage

STATUS = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "FAILED_PRECONDITION": 409,
    "ABORTED": 409,
    "PAYLOAD_TOO_LARGE": 413,
    "RESOURCE_EXHAUSTED": 429,
    "GONE": 410,
    "CANCELLED": 499,
    "INTERNAL": 500,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
#: a failed future's category: the caller's input ("user") or the service ("server")
USER_CODES = frozenset(
    {"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION", "UNAUTHENTICATED"}
)


class PayloadTooLargeError(TreadleError):
    """A request body over the server's size limit."""

    code = "PAYLOAD_TOO_LARGE"


class GoneError(TreadleError):
    """Something that was here and is no more: a future this server does not hold
    (the SDK resubmits its request), a finished session (its heartbeats stop)."""

    code = "GONE"


def status_of(err: TreadleError) -> int:
    return STATUS.get(err.code, 500)


def error_response(err: TreadleError, instance: str = "") -> JSONResponse:
    headers = {}
    body: dict[str, Any] = {"error": err.message, "code": err.code, "category": category(err)}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        body["retry_after_s"] = err.retry_after_s
    if instance:
        headers["X-Treadle-Instance"] = instance
    return JSONResponse(body, status_code=status_of(err), headers=headers)


def category(err: BaseException) -> str:
    if isinstance(err, TreadleError):
        return "user" if err.code in USER_CODES else "server"
    return "server"


def failed_future(err: BaseException) -> dict[str, str]:
    """What retrieve_future answers for a call that failed (the SDK raises it)."""
    err = database_outage(err) or err
    if isinstance(err, TreadleError):
        return {"error": f"{err.code}: {err.message}", "category": category(err)}
    return {"error": f"INTERNAL: {type(err).__name__}: {err}", "category": "server"}


async def treadle_error_handler(request: Request, err: Exception) -> JSONResponse:
    """For ``TreadleError`` and for the database's errors (an outage is UNAVAILABLE;
    any other is re-raised: a bug, answered 500)."""
    if not isinstance(err, TreadleError):
        outage = database_outage(err)
        if outage is None:
            raise err
        err = outage
    return error_response(err, getattr(request.app.state, "instance_id", ""))
