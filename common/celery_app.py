"""What the server and the workers agree on about Celery: the app's settings,
the one task, the exchanges, and how a reply is framed.

One task, ``treadle.call(cid, reply_to, payload)``, carries every call:
``payload`` is one ``treadle.common.engine.messages`` request, framed with its
version by ``treadle.common.engine.codec``; the reply is a ``messages.Reply``.
Tasks go to the worker's own queue, ``treadle.worker.<id>``, and replies to the
sending server's own queue, ``treadle.reply.<id>`` (``reply_to``), both through
the default (nameless) exchange: on Redis that saves a binding lookup, one round
trip, per message, and on RabbitMQ it routes by queue name just the same. A task
never waits: it hands the call to the engine and returns; the engine's future,
once resolved, is published by the worker to ``reply_to`` (the reply's ``cid``
names the call). Celery keeps no results (no result backend): ordering and
barriers are the engine's (by ``seq_id``), whatever order Celery delivers in.

Serializer: msgpack (bytes travel as bytes); JSON cannot carry bytes and
pickle would let a payload run code on a worker shared by every tenant.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from celery import Celery
from kombu import Queue

from treadle.common.engine import codec
from treadle.common.engine.messages import Reply
from treadle.errors import InternalError, InvalidArgumentError, TreadleError

TASK = "treadle.call"
#: content type of a reply body (raw codec bytes, no kombu serializer around them)
REPLY_CONTENT_TYPE = "application/x-treadle"
BROKER_SCHEMES = ("redis", "rediss", "amqp", "amqps", "pyamqp")


def check_broker_url(url: str, field: str = "broker") -> str:
    """redis://host[:port][/db] or amqp://user:pass@host[:port]/vhost, else a clear error."""
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018 - raises on a malformed port
    except ValueError as err:
        raise InvalidArgumentError(f"{field}: cannot parse {url!r}: {err}") from None
    if parsed.scheme not in BROKER_SCHEMES:
        raise InvalidArgumentError(
            f"{field}: {url!r} is not a broker URL; expected redis://host:6379/0 or "
            "amqp://user:password@host:5672// (schemes: " + ", ".join(BROKER_SCHEMES) + ")"
        )
    if not parsed.hostname:
        raise InvalidArgumentError(f"{field}: {url!r} names no host")
    return url


def make_celery(broker: str) -> Celery:
    app = Celery("treadle", broker=check_broker_url(broker), set_as_current=False)
    app.conf.update(
        task_serializer="msgpack",
        accept_content=["msgpack"],
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=False,  # a dead worker's calls are failed by the server, never redelivered
        worker_prefetch_multiplier=16,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        broker_connection_retry_on_startup=True,
        broker_heartbeat=0,
        task_create_missing_queues=False,
    )
    return app


def worker_queue(worker_id: str) -> Queue:
    """A worker's own queue; it goes when its worker goes (RabbitMQ auto-delete)."""
    name = f"treadle.worker.{worker_id}"
    return Queue(name, routing_key=name, durable=False, auto_delete=True)


def reply_queue(server_id: str) -> Queue:
    name = f"treadle.reply.{server_id}"
    return Queue(name, routing_key=name, durable=False, auto_delete=True)


def encode_reply(cid: str, outcome: Any, status: Any = None, *, more: bool = False) -> bytes:
    """``outcome``: a result, or an exception (sent as its treadle error). ``more``:
    one item of a streamed call (``SampleStream``), whose last reply comes later."""
    if isinstance(outcome, BaseException):
        err = (
            outcome
            if isinstance(outcome, TreadleError)
            else InternalError(f"{type(outcome).__name__}: {outcome}")
        )
        return codec.encode_message(Reply(cid, error=err, status=status))
    return codec.encode_message(Reply(cid, value=outcome, status=status, more=more))


def decode_reply(body: bytes) -> Reply:
    reply: Reply = codec.decode_message(body, (Reply,))
    return reply
