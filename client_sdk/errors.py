"""One error hierarchy for the whole system.

The engine and the server raise these; one server interceptor maps them to gRPC
status codes, and the SDK maps status codes back to the same classes, so a user
catches ``treadle.InvalidArgumentError`` whether the check ran locally or on the
server. The module imports nothing from grpc: the code names below are the
canonical gRPC status names, and the mapping to ``grpc.StatusCode`` lives in
``treadle.server.rpc.interceptors`` (server side) and ``treadle._rpc`` (SDK side); the
error's kind, details and retry delay travel as trailers (``treadle.wire.metadata``).
"""

from __future__ import annotations

from collections.abc import Mapping


class TreadleError(Exception):
    """Base of every error treadle raises on purpose."""

    code: str = "UNKNOWN"
    #: tells apart subclasses that share a status code (sent in trailing metadata)
    kind: str = ""
    #: what a kind carries besides its message (sent in trailing metadata)
    details: dict[str, str] = {}  # noqa: RUF012 (never mutated; instances set their own)

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


class ServerRestartedError(AbortedError):
    """The server restarted and brought the model back at its last checkpoint,
    behind the calls this client numbered after it: those calls can never be
    applied in order, so the call is refused at once instead of waiting out the
    gap timeout. ``model_id``, ``step`` and ``seq_id`` (the last applied call)
    say where the model is back, ``checkpoint`` what it came from (``""``: its
    creation state); ``TrainingClient.resync()`` continues from there, and
    ``ServiceClient(auto_resync=True)`` replays the lost calls instead.

    On the wire it is ABORTED, told apart by ``treadle-error-kind`` in the
    trailing metadata, which also carries these fields (``treadle-restart-*``)."""

    kind = "server_restarted"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        details: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        d = dict(details or {})
        self.details = d
        self.model_id = d.get("model_id", "")
        self.step = int(d.get("step", "0") or 0)
        self.seq_id = int(d.get("seq_id", "0") or 0)
        self.checkpoint = d.get("checkpoint", "")

    @property
    def next_seq_id(self) -> int:
        """The seq_id the server expects next for the model."""
        return self.seq_id + 1


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


#: the subclasses that share a code with another, by their ``kind``
ERRORS_BY_KIND: dict[str, type[ServerRestartedError]] = {
    cls.kind: cls for cls in (ServerRestartedError,)
}


def error_for_code(
    code: str,
    message: str,
    retry_after_s: float | None = None,
    *,
    kind: str = "",
    details: Mapping[str, str] | None = None,
) -> TreadleError:
    special = ERRORS_BY_KIND.get(kind)
    if special is not None and special.code == code:
        return special(message, retry_after_s=retry_after_s, details=details)
    cls = ERRORS_BY_CODE.get(code, TreadleError)
    err = cls(message, retry_after_s=retry_after_s)
    if cls is TreadleError:
        err.code = code
    return err
