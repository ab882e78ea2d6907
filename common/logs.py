"""Logs every process writes the same way: text or one JSON object a line, each
line stamped with the request id of the call it is about.

The SDK sends a request id with every call (``treadle.wire.metadata.REQUEST_ID_KEY``,
the same for each retry of the call). The server's interceptor sets it here for
the handler's coroutine; the Celery dispatcher sends it with the task; the
worker sets it again while it hands the call to its engine. So ``grep`` of one
id in the JSON logs of the server and of every worker follows one call end to
end. Code that logs outside the call's context (the engine thread, a reply
thread) passes ``extra={"request_id": ...}`` instead.

Lives under ``workers`` because the server and the workers both use it (the
workers never import the server).
"""

from __future__ import annotations

import argparse
import contextvars
import datetime as dt
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("treadle_request_id", default="")

#: LogRecord attributes that are not "extra" fields of a call
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)


def current_request_id() -> str:
    """The request id of the call this code runs for (``""``: none)."""
    return _request_id.get()


@contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Lines logged inside carry ``request_id``."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request id (unless it has one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = _request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message,
    request_id when the line is about a call, the exception's traceback when
    there is one, and the record's ``extra`` fields."""

    def __init__(self, process: str = "") -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.process:
            out["process"] = self.process
        request_id = getattr(record, "request_id", "") or _request_id.get()
        if request_id:
            out["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out and key != "request_id":
                out[key] = value if isinstance(value, (str, int, float, bool)) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def current_log_format() -> str:
    """``json`` when the root logger writes JSON lines (a child process follows it)."""
    json_out = any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
    return "json" if json_out else "text"


def configure_logging(fmt: str = "text", *, verbose: bool = False, process: str = "") -> None:
    """The root logger of a ``treadle`` process: INFO with ``verbose`` (one line
    per call), WARNING otherwise; ``fmt`` ``text`` or ``json``."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log_format: {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)


def add_observe_flags(parser: argparse.ArgumentParser) -> None:
    """``--log-format`` and the metrics endpoint: the same on server and worker."""
    env = os.environ.get
    parser.add_argument(
        "--log-format",
        default=env("TREADLE_LOG_FORMAT", "text"),
        choices=LOG_FORMATS,
        help="text, or json: one JSON object a line with the request id of the call "
        "(with -v: one line per call); env TREADLE_LOG_FORMAT",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("TREADLE_METRICS_PORT", "-1")),
        help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics "
        "(default: off; 0: any free port); env TREADLE_METRICS_PORT",
    )
    parser.add_argument(
        "--metrics-host",
        default=env("TREADLE_METRICS_HOST", "127.0.0.1"),
        help="address of the metrics endpoint (0.0.0.0: every interface); env TREADLE_METRICS_HOST",
    )


def metrics_port_of(args: argparse.Namespace) -> int | None:
    """None: no metrics endpoint (a negative ``--metrics-port``, the default)."""
    port = int(args.metrics_port)
    return None if port < 0 else port
