"""The SDK's gRPC plumbing: channel options, auth metadata, status -> error mapping,
and retries of calls that are safe to repeat (ordered calls carry their seq_id,
so a repeat is de-duplicated by the engine)."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc

from treadle.errors import TreadleError, UnavailableError, error_for_code

log = logging.getLogger("treadle")

#: gRPC's 4 MB default is far too small for batches, tokenizers and checkpoints.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
RETRY_AFTER_KEY = "treadle-retry-after-s"
RETRYABLE = {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}
#: how long, in all, a call waits out quota refusals (RESOURCE_EXHAUSTED with a delay)
QUOTA_WAIT_S = 600.0

T = TypeVar("T")


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def make_channel(address: str, root_certificates: bytes | None = None) -> grpc.Channel:
    if root_certificates is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        return grpc.secure_channel(address, creds, options=channel_options())
    return grpc.insecure_channel(address, options=channel_options())


def error_from_rpc(err: grpc.RpcError) -> TreadleError:
    code = err.code().name if hasattr(err, "code") and err.code() is not None else "UNKNOWN"
    details = err.details() if hasattr(err, "details") else str(err)
    retry_after = None
    for key, value in (err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else ():
        if key == RETRY_AFTER_KEY:
            retry_after = float(value)
    return error_for_code(code, details or code, retry_after)


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

    def call(
        self,
        method: grpc.UnaryUnaryMultiCallable,
        request: Any,
        convert: Callable[[Any], T],
        *,
        retry: bool = True,
    ) -> Future[T]:
        out: Future[T] = Future()
        self._attempt(method, request, convert, out, attempt=0, retry=retry, waited=0.0)
        return out

    def _attempt(
        self,
        method: Any,
        request: Any,
        convert: Callable[[Any], T],
        out: Future[T],
        *,
        attempt: int,
        retry: bool,
        waited: float,
    ) -> None:
        if out.cancelled():
            return
        try:
            rpc = method.future(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as err:  # pragma: no cover - synchronous failures are rare
            out.set_exception(error_from_rpc(err))
            return

        def done(f: grpc.Future) -> None:
            if out.cancelled():
                return
            try:
                response = f.result()
            except grpc.RpcError as err:
                error = error_from_rpc(err)
                delay = self._retry_delay(error, attempt, waited) if retry else None
                if delay is not None:
                    quota = error.code == "RESOURCE_EXHAUSTED"
                    log.warning(
                        "treadle: %s; %s, retrying in %.2fs",
                        error,
                        "over quota" if quota else f"attempt {attempt + 1}",
                        delay,
                    )
                    timer = threading.Timer(
                        delay,
                        self._attempt,
                        (method, request, convert, out),
                        {
                            "attempt": attempt if quota else attempt + 1,
                            "retry": retry,
                            "waited": waited + delay if quota else waited,
                        },
                    )
                    timer.daemon = True
                    timer.start()
                    return
                out.set_exception(error)
                return
            except Exception as exc:  # cancelled grpc future, etc.
                out.set_exception(UnavailableError(str(exc) or type(exc).__name__))
                return
            try:
                out.set_result(convert(response))
            except Exception as exc:
                out.set_exception(exc)

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


def wait(fut: Future[T], timeout: float | None) -> T:
    deadline = None if timeout is None else time.monotonic() + timeout
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    return fut.result(remaining)
