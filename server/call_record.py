"""What the outermost interceptor knows of the call it is timing: its RPC, its
request id, and the tenant ``AuthInterceptor`` found (``""`` until then, and for a
caller without a valid key). A mutable record in a context variable, so an inner
interceptor can fill in what the outer one reports when the call ends."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass
class CallRecord:
    rpc: str
    request_id: str
    tenant: str = ""


_current: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar(
    "treadle_call_record", default=None
)


def current_call() -> CallRecord | None:
    return _current.get()


def set_current_call(record: CallRecord) -> contextvars.Token[CallRecord | None]:
    return _current.set(record)


def reset_current_call(token: contextvars.Token[CallRecord | None]) -> None:
    _current.reset(token)


def note_tenant(tenant_id: str) -> None:
    """Called once the caller is authenticated: its tenant id (never its key)."""
    record = _current.get()
    if record is not None:
        record.tenant = tenant_id
