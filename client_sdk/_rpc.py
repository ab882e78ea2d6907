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
        self, api_key: str | None, *, max_retries: int = 5, timeout_s: float | None = None
    ) -> None:
        key = api_key or os.environ.get("TREADLE_API_KEY")
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {key}"),) if key else ()
        )
        self.max_retries = max_retries
        self.timeout_s = timeout_s

    def call(
        self,
        method: grpc.UnaryUnaryMultiCallable,
        request: Any,
        convert: Callable[[Any], T],
        *,
        retry: bool = True,
    ) -> Future[T]:
        out: Future[T] = Future()
        self._attempt(method, request, convert, out, attempt=0, retry=retry)
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
                if retry and error.code in RETRYABLE and attempt < self.max_retries:
                    delay = error.retry_after_s or min(8.0, 0.2 * 2**attempt) * (
                        0.5 + random.random()
                    )
                    log.warning(
                        "treadle: %s; retrying in %.1fs (attempt %d)", error, delay, attempt + 1
                    )
                    timer = threading.Timer(
                        delay,
                        self._attempt,
                        (method, request, convert, out),
                        {"attempt": attempt + 1, "retry": retry},
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


def wait(fut: Future[T], timeout: float | None) -> T:
    deadline = None if timeout is None else time.monotonic() + timeout
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    return fut.result(remaining)
