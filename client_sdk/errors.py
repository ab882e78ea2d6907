"""One error hierarchy for the whole system.

The engine and the server raise these; one server interceptor maps them to gRPC
status codes, and the SDK maps status codes back to the same classes, so a user
catches ``treadle.InvalidArgumentError`` whether the check ran locally or on the
server. The module imports nothing from grpc: the code names below are the
canonical gRPC status names, and the mapping to ``grpc.StatusCode`` lives in
``treadle.server.interceptors`` (server side) and ``treadle._rpc`` (SDK side).
"""

from __future__ import annotations


class TreadleError(Exception):
    """Base of every error treadle raises on purpose."""

    code: str = "UNKNOWN"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgumentError(TreadleError):
    """Bad input; the message names the offending field."""

    code = "INVALID_ARGUMENT"


class NotFoundError(TreadleError):
    """The id does not exist, or belongs to another tenant (indistinguishable)."""

    code = "NOT_FOUND"


class AlreadyExistsError(TreadleError):
    code = "ALREADY_EXISTS"


class FailedPreconditionError(TreadleError):
    """E.g. a repeated seq_id with a different payload."""

    code = "FAILED_PRECONDITION"


class AbortedError(TreadleError):
    """E.g. a call waited too long for a missing predecessor seq_id."""

    code = "ABORTED"


class ResourceExhaustedError(TreadleError):
    """Quota or capacity; ``retry_after_s`` says when to try again."""

    code = "RESOURCE_EXHAUSTED"


class UnavailableError(TreadleError):
    """A worker fault or shutdown; the model stays at its last applied step."""

    code = "UNAVAILABLE"


class UnauthenticatedError(TreadleError):
    code = "UNAUTHENTICATED"


class DeadlineExceededError(TreadleError):
    code = "DEADLINE_EXCEEDED"


class CancelledError(TreadleError):
    code = "CANCELLED"


class InternalError(TreadleError):
    code = "INTERNAL"


class UnimplementedError(TreadleError):
    """This deployment does not offer the call (e.g. streamed sampling on Celery workers)."""

    code = "UNIMPLEMENTED"


class NoGradientWarning(UserWarning):
    """An ``optim_step`` found no gradient since the previous one, and still moved
    the weights (Adam's momentum). Not an error: the step is applied as the
    optimizer's formula says; filter it with ``warnings.filterwarnings``."""


ERRORS_BY_CODE: dict[str, type[TreadleError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        AbortedError,
        ResourceExhaustedError,
        UnavailableError,
        UnauthenticatedError,
        DeadlineExceededError,
        CancelledError,
        InternalError,
        UnimplementedError,
    )
}


def error_for_code(code: str, message: str, retry_after_s: float | None = None) -> TreadleError:
    cls = ERRORS_BY_CODE.get(code, TreadleError)
    err = cls(message, retry_after_s=retry_after_s)
    if cls is TreadleError:
        err.code = code
    return err
