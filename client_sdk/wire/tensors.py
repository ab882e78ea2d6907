"""numpy <-> wire tensors: packed little-endian bytes with dtype and shape.

Shared by the SDK and the server, so both ends pack tensors one way: the SDK's
converters (``treadle._convert``) and the server's (``treadle.server.rpc.convert``)
both call these two functions.
"""

from __future__ import annotations

import math

import numpy as np

from treadle.errors import InvalidArgumentError
from treadle.v1 import common_pb2

_TO_WIRE = {
    np.dtype("float32"): common_pb2.FLOAT32,
    np.dtype("float64"): common_pb2.FLOAT64,
    np.dtype("int64"): common_pb2.INT64,
    np.dtype("int32"): common_pb2.INT32,
}
_FROM_WIRE: dict[int, np.dtype] = {
    common_pb2.FLOAT32: np.dtype("<f4"),
    common_pb2.FLOAT64: np.dtype("<f8"),
    common_pb2.INT64: np.dtype("<i8"),
    common_pb2.INT32: np.dtype("<i4"),
}


def to_wire(array: np.ndarray, out: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    arr = np.asarray(array)
    if arr.dtype not in _TO_WIRE:
        arr = arr.astype(np.float32 if arr.dtype.kind == "f" else np.int64)
    msg = out if out is not None else common_pb2.Tensor()
    msg.dtype = _TO_WIRE[arr.dtype]
    msg.shape[:] = arr.shape
    msg.data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
    return msg


def from_wire(msg: common_pb2.Tensor, field: str) -> np.ndarray:
    """Decode a wire tensor; ``field`` names it in the error if it is malformed."""
    dtype = _FROM_WIRE.get(msg.dtype)
    if dtype is None:
        if msg.dtype == common_pb2.BFLOAT16:
            if len(msg.data) % 2:
                raise InvalidArgumentError(
                    f"{field}: {len(msg.data)} bytes is not a whole number of bfloat16"
                )
            raw = np.frombuffer(msg.data, dtype="<u2").astype(np.uint32) << 16
            arr = raw.view(np.float32)
        else:
            raise InvalidArgumentError(f"{field}: unsupported or missing dtype")
    else:
        if len(msg.data) % dtype.itemsize:
            raise InvalidArgumentError(
                f"{field}: {len(msg.data)} bytes is not a whole number of {dtype.name}"
            )
        arr = np.frombuffer(msg.data, dtype=dtype)
    shape = tuple(msg.shape) or (arr.size,)
    # Python ints: np.prod would wrap around; a negative dim is never a shape
    if any(d < 0 for d in shape) or math.prod(shape) != arr.size:
        raise InvalidArgumentError(
            f"{field}: shape {list(shape)} does not match {arr.size} elements"
        )
    return arr.reshape(shape).astype(arr.dtype.newbyteorder("="), copy=False)
