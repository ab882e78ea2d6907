"""The wire between a server and its workers: one typed message per engine call.

Every call message has its handler in the engine, which makes exactly that
call and answers the message's result type; each round-trips through the
codec; a worker dispatches on the message's type and refuses a message of
another version or type by name; a reply of the wrong type fails the call on
the server.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest

from tests.unit.engine.test_codec import _same
from tests.unit.engine_ops import RecordingAPI
from treadle.common.celery_app import decode_reply, encode_reply
from treadle.common.engine import codec
from treadle.common.engine import messages as m
from treadle.common.engine.domain import (
    AdamConfig,
    ModelSpec,
    ModelStatus,
    OptimStepOp,
    OptimStepResult,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SaveResult,
    SequenceResult,
)
from treadle.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
)
from treadle.server.celery.transport import Pending, _outcome
from treadle.workers.engine import calls
from treadle.workers.engine.loop import Engine, EngineConfig
from treadle.workers.worker.celery_worker import WorkerProcess

TARGET = SamplerTarget("tiny", "m-1", 3, tenant_id="t-1")
PARAMS = SamplingConfig(max_tokens=4, stop_strings=("\n",))
SEQ = SequenceResult(np.array([5, 6]), np.array([-0.1, -0.2], np.float32), "stop", ((0, 2, 3),))

#: one request of each type, with what the engine answers to it
EXAMPLES: list[m.EngineCall[Any]] = [
    m.CreateModelCall(ModelSpec("m-1", "t-1", "tiny", 8, 16.0, 3, "float32"), "s3://b/ckpt", 4),
    m.DeleteModelCall("m-1"),
    m.UnloadModelCall("m-1", "s3://b/unload", force=True),
    m.SubmitCall("m-1", 7, OptimStepOp(AdamConfig(learning_rate=1e-3)), "digest"),
    m.SampleCall(TARGET, SampleOp(np.arange(5), 2, PARAMS), ("sampler-1", 3, "d")),
    m.SampleStreamCall(TARGET, SampleOp(np.arange(5), 1, PARAMS)),
    m.ResumeCall(TARGET, ("rh-1", "rh-2"), PARAMS, "sampler-1"),
    m.CheckTargetCall(TARGET),
    m.ExportCall("m-1", "s3://b/export", merged=True),
    m.ShipVersionCall("m-1", 3, "s3://b/pool-v3"),
    m.LoadVersionCall(TARGET, "s3://b/pool-v3", inflight=True, latest=True),
]

ANSWERS: dict[str, Any] = {
    "create_model": ModelStatus("m-1", 3, 4, 0),
    "delete_model": None,
    "unload_model": SaveResult(step=3, seq_id=9, size_bytes=10),
    "submit": OptimStepResult(step=4, metrics={"grad_norm": 0.5}),
    "sample": SampleResult((SEQ,)),
    "resume": SampleResult((SEQ, SEQ)),
    "check_sampler_target": 3,
    "export_weights": ["adapter_model.safetensors", "adapter_config.json"],
    "ship_version": 1234,
    "load_version": 3,
}


def test_every_call_has_its_handler_and_answers_its_response_type() -> None:
    assert {type(msg) for msg in EXAMPLES} == set(m.CALLS.values())
    assert set(calls.HANDLERS) == set(m.CALLS.values())
    called = set()
    for msg in EXAMPLES:
        api = RecordingAPI(ANSWERS, SEQ)
        answer = api.call(msg).result(timeout=1)
        ((name, _, _),) = api.calls
        called.add(name)
        assert isinstance(answer, type(msg).response), (msg, answer)
    assert called == set(ANSWERS)


def test_an_engine_refuses_a_call_it_has_no_handler_for(tiny_model_dir: Path) -> None:
    @dataclass(frozen=True)
    class Unknown(m.EngineCall[int]):
        response = (int,)

    engine = Engine(EngineConfig(base_models={"tiny": tiny_model_dir}))
    with pytest.raises(InternalError, match="no engine handler for Unknown"):
        engine.call(Unknown()).result(timeout=1)


def test_calls_pass_their_fields_to_the_engine() -> None:
    api = RecordingAPI(ANSWERS, SEQ)
    create, delete, unload, submit, sample, stream, resume, check, export, ship, load = EXAMPLES
    for msg in EXAMPLES:
        api.call(msg)
    assert [
        (n, a, {k: v for k, v in kw.items() if k != "on_sequence"}) for n, a, kw in api.calls
    ] == [
        ("create_model", (create.spec,), {"from_state": "s3://b/ckpt", "next_seq_id": 4}),  # type: ignore[attr-defined]
        ("delete_model", ("m-1",), {}),
        ("unload_model", ("m-1", "s3://b/unload"), {"force": True}),
        ("submit", ("m-1", 7, submit.op, "digest"), {}),  # type: ignore[attr-defined]
        ("sample", (TARGET, sample.op), {"dedupe_key": ("sampler-1", 3, "d")}),  # type: ignore[attr-defined]
        ("sample", (TARGET, stream.op), {}),  # type: ignore[attr-defined]
        ("resume", (TARGET, ("rh-1", "rh-2"), PARAMS), {}),
        ("check_sampler_target", (TARGET,), {}),
        ("export_weights", ("m-1", "s3://b/export"), {"merged": True}),
        ("ship_version", ("m-1", 3, "s3://b/pool-v3"), {}),
        ("load_version", (TARGET, "s3://b/pool-v3"), {"inflight": True, "latest": True}),
    ]
    assert api.call(ship).result() == m.Shipped(3, 1234)
    assert api.call(load).result() == m.TargetVersion(3)
    assert api.call(m.ExportCall("m", "p", merged=True)).result() == m.Exported(
        ("adapter_model.safetensors", "adapter_config.json")
    )
    assert api.call(check).result() == m.TargetVersion(3)
    assert api.call(delete).result() == m.Deleted("m-1")


def test_calls_route_to_their_model_or_sampler_target() -> None:
    create, delete, unload, submit, sample, stream, resume, check, export, ship, load = EXAMPLES
    for msg in (create, delete, unload, submit, export, ship):
        assert msg.route == m.CallRoute(model_id="m-1"), msg
    assert load.route == m.CallRoute(target=TARGET)
    assert sample.route == m.CallRoute(target=TARGET, sampler_key="sampler-1")
    assert resume.route == m.CallRoute(target=TARGET, sampler_key="sampler-1")
    assert stream.route == check.route == m.CallRoute(target=TARGET)
    assert [msg for msg in EXAMPLES if msg.ordered] == [submit]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda msg: type(msg).__name__)
def test_each_call_round_trips_through_the_codec(msg: m.EngineCall[Any]) -> None:
    data = codec.encode_message(msg)
    _same(msg, codec.decode_message(data, tuple(m.CALLS.values())))


def test_replies_round_trip_values_errors_and_status() -> None:
    status = ModelStatus("m-1", 3, 4, 0)
    ok = decode_reply(encode_reply("c1", SampleResult((SEQ,)), status))
    assert ok.cid == "c1" and ok.error is None and ok.status == status and not ok.more
    _same(ok.value, SampleResult((SEQ,)))
    bad = decode_reply(encode_reply("c2", NotFoundError("model m-9 not found")))
    assert isinstance(bad.error, NotFoundError) and bad.error.message == "model m-9 not found"
    bug = decode_reply(encode_reply("c3", KeyError("x")))
    assert isinstance(bug.error, InternalError) and "KeyError" in bug.error.message


def test_another_version_or_type_is_refused_by_name() -> None:
    requests = tuple(m.CALLS.values())
    body = codec.encode(m.DeleteModelCall("m-1"))  # the message without its version
    with pytest.raises(codec.CodecError, match="carries no message version"):
        codec.decode_message(body, requests)
    newer = msgpack.packb(m.VERSION + 1) + body
    with pytest.raises(codec.CodecError, match=f"message version {m.VERSION + 1}, but this side"):
        codec.decode_message(newer, requests)
    unknown = msgpack.packb(m.VERSION) + msgpack.packb(
        msgpack.ExtType(2, msgpack.packb(("RenameModel", {"model_id": "m-1"})))
    )
    with pytest.raises(codec.CodecError, match="unknown domain type 'RenameModel'"):
        codec.decode_message(unknown, requests)
    status = ModelStatus("m-1", 3, 4, 0)
    not_a_request = msgpack.packb(m.VERSION) + codec.encode(status)
    with pytest.raises(codec.CodecError, match="unexpected message ModelStatus"):
        codec.decode_message(not_a_request, requests)
    with pytest.raises(codec.CodecError, match="not an engine message"):
        codec.encode_message(status)
    assert issubclass(codec.CodecError, InvalidArgumentError)


class _Replies:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any, str | None, bool]] = []

    def put(
        self, reply_to: str, cid: str, outcome: Any, model_id: str | None, *, more: bool = False
    ) -> None:
        if isinstance(outcome, Future):
            outcome = outcome.result()
        self.sent.append((cid, outcome, model_id, more))


def _worker(capacity: int = 4, role: str = "both") -> Any:
    """A ``WorkerProcess`` without its broker, database and engine: the task alone."""
    w = WorkerProcess.__new__(WorkerProcess)
    w.staged = w.api = RecordingAPI(ANSWERS, SEQ)  # type: ignore[assignment]
    w.engine = SimpleNamespace(has_model=lambda _: False)  # type: ignore[assignment]
    w.replies = _Replies()  # type: ignore[assignment]
    w.config = SimpleNamespace(capacity=capacity, role=role)  # type: ignore[assignment]
    w.worker_id = "w-1"
    w.hosted = set()
    w._hosted_lock = threading.Lock()
    w._calls = 0
    return w


def test_the_worker_dispatches_on_the_message_type() -> None:
    w = _worker()
    for i, msg in enumerate(EXAMPLES):
        w.handle(f"c{i}", "reply-q", codec.encode_message(msg))
    assert [name for name, _, _ in w.staged.calls] == [
        "create_model",
        "delete_model",
        "unload_model",
        "submit",
        "sample",
        "sample",
        "resume",
        "check_sampler_target",
        "export_weights",
        "ship_version",
        "load_version",
    ]
    sent = {cid: (out, model_id, more) for cid, out, model_id, more in w.replies.sent if not more}
    assert sent["c0"] == (ANSWERS["create_model"], "m-1", False)  # carries its status
    assert sent["c3"] == (ANSWERS["submit"], "m-1", False)
    assert sent["c5"] == (m.StreamEnd(1), None, False)
    assert sent["c7"] == (m.TargetVersion(3), None, False)
    (item,) = [out for cid, out, _, more in w.replies.sent if more]
    assert item.index == 0 and item.sequence is SEQ  # the streamed sample, before its end
    assert w.hosted == set() and w._calls == 0  # created, then deleted; all answered


def test_a_sampler_worker_refuses_training_calls_and_serves_samplers() -> None:
    w = _worker(role="sampler")
    for i, msg in enumerate(EXAMPLES):
        w.handle(f"c{i}", "reply-q", codec.encode_message(msg))
    names = [name for name, _, _ in w.staged.calls]
    assert "create_model" not in names and "submit" not in names
    assert {"sample", "resume", "check_sampler_target", "load_version"} <= set(names)
    sent = {cid: out for cid, out, _, more in w.replies.sent if not more}
    for cid in ("c0", "c3"):  # CreateModelCall, SubmitCall
        assert isinstance(sent[cid], FailedPreconditionError)
        assert "sampler worker (--role sampler)" in sent[cid].message
    assert sent["c10"] == m.TargetVersion(3)
    assert w.hosted == set()  # no training model, so no optimizer state


def test_the_worker_refuses_another_version_with_a_clear_error() -> None:
    w = _worker()
    body = msgpack.packb(m.VERSION + 1) + codec.encode(m.DeleteModelCall("m-1"))
    w.handle("c1", "reply-q", body)
    assert w.staged.calls == []
    ((cid, err, _, _),) = w.replies.sent
    assert cid == "c1" and isinstance(err, codec.CodecError)
    back = decode_reply(encode_reply(cid, err)).error
    assert isinstance(back, InvalidArgumentError) and "message version" in back.message


def test_the_server_fails_a_reply_of_the_wrong_type() -> None:
    loop = asyncio.new_event_loop()
    try:
        pending = Pending(loop.create_future(), loop, "w-1", None, m.CheckTargetCall(TARGET))
        wrong = _outcome(pending, decode_reply(encode_reply("c", SampleResult((SEQ,)))))
        assert isinstance(wrong, InternalError)
        assert "answered CheckTargetCall with SampleResult" in wrong.message
        right = _outcome(pending, decode_reply(encode_reply("c", m.TargetVersion(4))))
        assert right == m.TargetVersion(4)
    finally:
        loop.close()


def test_a_reply_of_another_version_fails_its_call_with_the_reason() -> None:
    from treadle.server.celery.transport import CeleryTransport

    transport = CeleryTransport.__new__(CeleryTransport)
    transport._lock = threading.Lock()
    transport._on_status = lambda status: None
    loop = asyncio.new_event_loop()
    try:
        fut = loop.create_future()
        transport._pending = {"c1": Pending(fut, loop, "w-1", None, m.DeleteModelCall("m-1"))}
        reply = codec.encode(m.Reply("c1", value=m.Deleted("m-1")))
        newer = SimpleNamespace(body=msgpack.packb(m.VERSION + 1) + reply, headers={"cid": "c1"})
        transport._on_reply(newer)
        loop.run_until_complete(asyncio.wait_for(asyncio.shield(fut), 1))
    except InvalidArgumentError as err:
        assert "message version" in err.message
        assert transport._pending == {}
    else:
        raise AssertionError("the call did not fail")
    finally:
        loop.close()


def test_every_ordered_op_has_its_handler_and_declares_what_it_stages() -> None:
    from typing import get_args

    from treadle.common.engine.domain import OrderedOp
    from treadle.workers.engine.op_handlers import OP_HANDLERS

    ops = set(get_args(OrderedOp))
    assert set(OP_HANDLERS) == ops
    staged = {op.__name__: (op.fetches, op.uploads) for op in ops if op.fetches or op.uploads}
    assert staged == {
        "LoadStateOp": (("directory",), ()),
        "SaveStateOp": ((), ("directory",)),
        "ForwardLogprobsOp": (("reference_weights.directory",), ()),
    }
