"""A lost database connection is an outage, not a bug: the one place that tells
them apart, so every transport answers it UNAVAILABLE (retryable) instead of
INTERNAL. A call that failed so was applied at most once: its ops row is either
absent (the SDK's repeat applies it) or pending (the repeat gets the engine's
recorded result and finishes the row)."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from treadle.errors import UnavailableError


def database_outage(err: BaseException) -> UnavailableError | None:
    """``UnavailableError`` for an error of a database that cannot be reached (down,
    restarting, connection cut, SQLite locked), None for any other error. The
    message names no host: it goes to tenants."""
    lost = isinstance(err, (OperationalError, InterfaceError)) or (
        isinstance(err, DBAPIError) and err.connection_invalidated
    )
    if not lost:
        return None
    return UnavailableError(
        "the server's database is unreachable (restarting?); nothing was lost: "
        "send the call again in a few seconds"
    )
