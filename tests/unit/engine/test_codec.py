"""The Celery codec round-trips every domain type, arrays bit for bit, and
refuses what is not a treadle message."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from treadle.common.engine import codec
from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardResult,
    LoadStateOp,
    ModelSpec,
    ModelStatus,
    OptimStepOp,
    RejectedOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SequenceResult,
)
from treadle.errors import AbortedError, InternalError, InvalidArgumentError


def _same(a: object, b: object) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, BaseException):
        assert type(a) is type(b) and str(a) == str(b)
    else:
        assert a == b


def test_round_trips_ops_and_results() -> None:
    rng = np.random.default_rng(0)
    datum = DatumData(
        tokens=np.arange(7, dtype=np.int64),
        inputs={
            "weights": rng.random(7).astype(np.float32),
            "advantages": rng.standard_normal(7),
        },
    )
    values = [
        ModelSpec("m-1", "t-1", "tiny", 8, 16.0, 3, "float32"),
        ForwardBackwardOp((datum, datum), "ppo", {"clip_low_threshold": 0.8}, temperature=0.7),
        OptimStepOp(AdamConfig(learning_rate=1e-3)),
        LoadStateOp("s3://bucket/x/t-1/m-1/a"),
        ForwardResult((np.zeros(3, np.float32), np.ones(2, np.float32)), {"loss:sum": 1.5}),
        SampleOp(np.array([1, 2, 3]), 4, SamplingConfig(stop_strings=("\n",), seed=None)),
        SampleResult(
            (
                SequenceResult(
                    np.array([5, 6]), np.array([-0.1, -0.2], np.float32), "stop", ((0, 2, 3),)
                ),
            )
        ),
        SamplerTarget("tiny", "m-1", None),
        ModelStatus("m-1", 2, 9, 4),
        {"cid": "abc", "ok": True, "blob": b"\x00\xff", "n": None},
    ]
    for value in values:
        _same(value, codec.decode(codec.encode(value)))


def test_errors_keep_their_code_and_message() -> None:
    rejected = RejectedOp(InvalidArgumentError("data[0].weights: wrong length"), kind="ppo")
    back = codec.decode(codec.encode(rejected))
    assert isinstance(back.error, InvalidArgumentError)
    assert back.error.message == "data[0].weights: wrong length"
    err = codec.decode(codec.encode(AbortedError("gap", retry_after_s=1.5)))
    assert isinstance(err, AbortedError) and err.retry_after_s == 1.5
    other = codec.decode(codec.encode(ZeroDivisionError("boom")))
    assert isinstance(other, InternalError) and "boom" in other.message


def test_every_domain_dataclass_is_allowed() -> None:
    from treadle.common.engine import domain

    for name in dir(domain):
        obj = getattr(domain, name)
        if isinstance(obj, type) and dataclasses.is_dataclass(obj):
            assert codec.DOMAIN_TYPES.get(name) is obj


def test_refuses_foreign_types_and_garbage() -> None:
    @dataclasses.dataclass
    class Foreign:
        x: int

    with pytest.raises(codec.CodecError):
        codec.encode(Foreign(1))
    with pytest.raises(codec.CodecError):
        codec.encode(object())
    with pytest.raises(codec.CodecError):
        codec.encode(np.array([object()]))
    forged = msgpack.packb(msgpack.ExtType(2, msgpack.packb(("os.system", {}))))
    with pytest.raises(codec.CodecError, match="unknown domain type"):
        codec.decode(forged)
    with pytest.raises(codec.CodecError):
        codec.decode(b"\xc1garbage")
