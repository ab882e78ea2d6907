"""The gRPC metadata a call and its answer carry besides the message: the keys, the
request id, and an error written as trailers (the server) and read back (the SDK).

Writing and reading sit side by side so they cannot drift: a key the server
writes is the key the SDK reads.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from treadle.errors import TreadleError, error_for_code

#: server -> client on a refusal that passes with time (a quota): seconds to wait
RETRY_AFTER_KEY = "treadle-retry-after-s"
#: Server -> client on every answer: the id of the server process that answered
#: (new at each start). Client -> server on ordered calls: the instance the
#: client's seq_ids were numbered against, so a restarted server can tell at
#: once a gap that no call will ever fill (``ServerRestartedError``).
INSTANCE_KEY = "treadle-server-instance"
#: client -> server on ordered calls: the lowest seq_id of the model the client
#: still waits an answer for (the calls below it were answered)
FIRST_PENDING_KEY = "treadle-first-pending-seq-id"
#: server -> client on errors whose class shares its status code with another
ERROR_KIND_KEY = "treadle-error-kind"
#: prefix of the fields such an error carries (``TreadleError.details``)
ERROR_DETAIL_PREFIX = "treadle-detail-"
#: client -> server on every call: an id made by the SDK for the call (the same
#: for each of its retries), written on the log lines of the server and of the
#: worker that served it, so one call can be followed end to end
REQUEST_ID_KEY = "treadle-request-id"


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def error_trailers(err: TreadleError, instance: str = "") -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries what a status code cannot: the retry
    delay, the error's kind and details, the answering server's instance."""
    md: list[tuple[str, str]] = []
    if err.retry_after_s is not None:
        md.append((RETRY_AFTER_KEY, f"{err.retry_after_s:.3f}"))
    if err.kind:
        md.append((ERROR_KIND_KEY, err.kind))
        md.extend((ERROR_DETAIL_PREFIX + k.replace("_", "-"), v) for k, v in err.details.items())
    if instance:
        md.append((INSTANCE_KEY, instance))
    return tuple(md)


def error_from_trailers(
    code: str, message: str, trailers: Iterable[tuple[str, Any]]
) -> TreadleError:
    """The error ``error_trailers`` wrote, from a status code name, its message and
    the trailers that came with it."""
    retry_after = None
    kind = ""
    fields: dict[str, str] = {}
    for key, value in trailers:
        if key == RETRY_AFTER_KEY:
            retry_after = float(value)
        elif key == ERROR_KIND_KEY:
            kind = str(value)
        elif key.startswith(ERROR_DETAIL_PREFIX):
            fields[key[len(ERROR_DETAIL_PREFIX) :].replace("-", "_")] = str(value)
    return error_for_code(code, message, retry_after, kind=kind, details=fields)
