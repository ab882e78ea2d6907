"""The SDK's gRPC plumbing: channel options, auth metadata, status -> error mapping,
and retries of calls that are safe to repeat (ordered calls carry their seq_id,
so a repeat is de-duplicated by the engine). Every answer says which server
instance gave it (``INSTANCE_KEY``); ``treadle._ordering`` uses that to learn
of a restart at once. What the server reads and writes too (metadata keys, the
channel options) is public, in ``treadle.wire``."""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, Generic, TypeVar

import grpc

from treadle.errors import TreadleError, UnavailableError
from treadle.wire.channel import channel_options
from treadle.wire.metadata import INSTANCE_KEY, REQUEST_ID_KEY, error_from_trailers, new_request_id

log = logging.getLogger("treadle")

RETRYABLE = {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}
#: how long, in all, a call waits out quota refusals (RESOURCE_EXHAUSTED with a delay)
QUOTA_WAIT_S = 600.0

T = TypeVar("T")


def make_channel(address: str, root_certificates: bytes | None = None) -> grpc.Channel:
    if root_certificates is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        return grpc.secure_channel(address, creds, options=channel_options())
    return grpc.insecure_channel(address, options=channel_options())


def trailers_of(rpc: Any) -> Sequence[tuple[str, Any]]:
    try:
        return tuple(rpc.trailing_metadata() or ())
    except Exception:  # not a call object (a channel-level failure)
        return ()


def error_from_rpc(err: grpc.RpcError) -> TreadleError:
    code = err.code().name if hasattr(err, "code") and err.code() is not None else "UNKNOWN"
    details = err.details() if hasattr(err, "details") else str(err)
    return error_from_trailers(code, details or code, trailers_of(err))


def instance_of(rpc: Any) -> str:
    """The server instance that answered (``""``: none said, e.g. no server reached)."""
    for key, value in trailers_of(rpc):
        if key == INSTANCE_KEY:
            return str(value)
    return ""


#: per attempt, metadata to add (an ordered call: the server instance its
#: seq_id was numbered against, and the model's lowest pending seq_id then)
ExtraMetadata = Callable[[], Sequence[tuple[str, str]]]
#: called with an error no retry fixes; True: the caller fixed its cause, send again
Recover = Callable[[TreadleError], bool]
#: how many times one call is sent again after its ``Recover`` said so
MAX_RECOVERIES = 3


class Caller:
    """Issues unary calls as futures, with metadata, deadlines and bounded retries."""

    def __init__(
        self,
        api_key: str | None,
        *,
        max_retries: int = 5,
        timeout_s: float | None = None,
        quota_wait_s: float = QUOTA_WAIT_S,
    ) -> None:
        key = api_key or os.environ.get("TREADLE_API_KEY")
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {key}"),) if key else ()
        )
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.quota_wait_s = quota_wait_s
        #: the server instance that answered last (``""``: none yet)
        self.server_instance = ""

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata of one call made outside ``call`` (a stream): auth and a new
        request id."""
        return (*self.metadata, (REQUEST_ID_KEY, new_request_id()))

    def call(
        self,
        method: grpc.UnaryUnaryMultiCallable,
        request: Any,
        convert: Callable[[Any], T],
        *,
        retry: bool = True,
        extra_metadata: ExtraMetadata | None = None,
        recover: Recover | None = None,
    ) -> Future[T]:
        out: Future[T] = Future()
        attempt = _Attempt(method, request, convert, out, retry, extra_metadata, recover)
        self._attempt(attempt, attempt=0, waited=0.0)
        return out

    def _attempt(self, call: _Attempt[Any], *, attempt: int, waited: float) -> None:
        out = call.out
        if out.done():  # cancelled, or failed by its client (a resync superseded it)
            return
        extra = call.extra_metadata() if call.extra_metadata is not None else ()
        try:
            rpc = call.method.future(
                call.request,
                timeout=self.timeout_s,
                metadata=(*self.metadata, (REQUEST_ID_KEY, call.request_id), *extra),
            )
        except grpc.RpcError as err:  # pragma: no cover - synchronous failures are rare
            settle_once(out, error=error_from_rpc(err))
            return

        def done(f: grpc.Future) -> None:
            if out.done():
                return
            instance = instance_of(f)
            if instance:
                self.server_instance = instance
            try:
                response = f.result()
            except grpc.RpcError as err:
                error = error_from_rpc(err)
                delay = self._retry_delay(error, attempt, waited) if call.retry else None
                if (
                    delay is None
                    and call.recover is not None
                    and call.recoveries < MAX_RECOVERIES
                    and call.recover(error)
                ):
                    call.recoveries += 1
                    self._attempt(call, attempt=attempt, waited=waited)
                    return
                if delay is not None:
                    quota = error.code == "RESOURCE_EXHAUSTED"
                    log.warning(
                        "treadle: %s; %s, retrying in %.2fs (request %s)",
                        error,
                        "over quota" if quota else f"attempt {attempt + 1}",
                        delay,
                        call.request_id,
                    )
                    timer = threading.Timer(
                        delay,
                        self._attempt,
                        (call,),
                        {
                            "attempt": attempt if quota else attempt + 1,
                            "waited": waited + delay if quota else waited,
                        },
                    )
                    timer.daemon = True
                    timer.start()
                    return
                settle_once(out, error=error)
                return
            except Exception as exc:  # cancelled grpc future, etc.
                settle_once(out, error=UnavailableError(str(exc) or type(exc).__name__))
                return
            try:
                settle_once(out, result=call.convert(response))
            except Exception as exc:
                settle_once(out, error=exc)

        rpc.add_done_callback(done)
        out.add_done_callback(lambda f: rpc.cancel() if f.cancelled() else None)

    def _retry_delay(self, error: TreadleError, attempt: int, waited: float) -> float | None:
        """Seconds to wait before trying again, or None to give up.

        A quota refusal says how long to wait (``retry_after_s``) and is waited out
        for up to ``quota_wait_s`` in all, not counted as a failed attempt; one
        without a delay (a request over the per-request quota) cannot succeed by
        waiting. UNAVAILABLE backs off exponentially, ``max_retries`` times."""
        if error.code == "RESOURCE_EXHAUSTED":
            if error.retry_after_s is None or waited >= self.quota_wait_s:
                return None
            return error.retry_after_s * (1.0 + 0.25 * random.random())  # spread the herd
        if error.code in RETRYABLE and attempt < self.max_retries:
            return min(8.0, 0.2 * 2**attempt) * (0.5 + random.random())
        return None


class _Attempt(Generic[T]):
    """One call's parts, the same for each of its attempts."""

    __slots__ = (
        "convert",
        "extra_metadata",
        "method",
        "out",
        "recover",
        "recoveries",
        "request",
        "request_id",
        "retry",
    )

    def __init__(
        self,
        method: Any,
        request: Any,
        convert: Callable[[Any], T],
        out: Future[T],
        retry: bool,
        extra_metadata: ExtraMetadata | None,
        recover: Recover | None,
    ) -> None:
        self.method, self.request, self.convert, self.out = method, request, convert, out
        self.retry, self.extra_metadata, self.recover = retry, extra_metadata, recover
        self.recoveries = 0
        self.request_id = new_request_id()  # one per call: its retries keep it


def settle_once(
    out: Future[Any], *, result: Any = None, error: BaseException | None = None
) -> None:
    """Resolve ``out`` unless something else (a cancel, a resync) already did."""
    try:
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(result)
    except InvalidStateError:
        pass
