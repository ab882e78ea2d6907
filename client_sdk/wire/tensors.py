"""numpy <-> wire tensors: packed little-endian bytes with dtype and shape.

Shared by the SDK and the server, so both ends pack tensors one way: the SDK's
converters (``treadle._convert``) and the server's (``treadle.server.rpc.convert``)
both call these functions.
"""

from __future__ import annotations

import array as _array
import math
import sys
from collections.abc import Sequence

import numpy as np

from treadle.errors import InvalidArgumentError
from treadle.v1 import common_pb2

_TO_WIRE = {
    np.dtype("float32"): common_pb2.FLOAT32,
    np.dtype("float64"): common_pb2.FLOAT64,
    np.dtype("int64"): common_pb2.INT64,
    np.dtype("int32"): common_pb2.INT32,
}
_LITTLE_ENDIAN = sys.byteorder == "little"
_FROM_WIRE: dict[int, np.dtype] = {
    common_pb2.FLOAT32: np.dtype("<f4"),
    common_pb2.FLOAT64: np.dtype("<f8"),
    common_pb2.INT64: np.dtype("<i8"),
    common_pb2.INT32: np.dtype("<i4"),
}


def to_wire(array: np.ndarray, out: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    arr = array if type(array) is np.ndarray else np.asarray(array)
    code = _TO_WIRE.get(arr.dtype)
    if code is None:
        arr = arr.astype(np.float32 if arr.dtype.kind == "f" else np.int64)
        code = _TO_WIRE[arr.dtype]
    msg = common_pb2.Tensor() if out is None else out
    msg.dtype = code
    if len(msg.shape):
        msg.shape[:] = arr.shape
    else:  # a new tensor: extending is several times cheaper than slice assignment
        msg.shape.extend(arr.shape)
    if _LITTLE_ENDIAN:  # the wire's byte order already: C-order bytes as they are
        msg.data = arr.tobytes()
    else:
        msg.data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
    return msg


def ints_to_wire(values: Sequence[int], out: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    """``to_wire(np.asarray(values, dtype=np.int64), out)``, the same bytes, without numpy
    for a sequence of Python ints (a token list)."""
    if _LITTLE_ENDIAN and (type(values) is tuple or type(values) is list):
        try:
            data = _array.array("q", values).tobytes()
        except (TypeError, OverflowError):  # not plain ints: numpy's conversion, as before
            pass
        else:
            msg = common_pb2.Tensor() if out is None else out
            msg.dtype = common_pb2.INT64
            if len(msg.shape):
                msg.shape[:] = (len(values),)
            else:
                msg.shape.append(len(values))
            msg.data = data
            return msg
    return to_wire(np.asarray(values, dtype=np.int64), out)


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
        data = msg.data  # one read: each makes a new bytes object
        if len(data) % dtype.itemsize:
            raise InvalidArgumentError(
                f"{field}: {len(data)} bytes is not a whole number of {dtype.name}"
            )
        arr = np.frombuffer(data, dtype=dtype)
    dims = msg.shape
    if len(dims) <= 1:  # one dimension (a token list), or none given: arr as it is
        if dims and dims[0] != arr.size:  # (a negative dim never equals a size)
            raise InvalidArgumentError(
                f"{field}: shape {[dims[0]]} does not match {arr.size} elements"
            )
        return arr if _LITTLE_ENDIAN else arr.astype(arr.dtype.newbyteorder("="), copy=False)
    shape = tuple(dims)
    # Python ints: np.prod would wrap around; a negative dim is never a shape
    if any(d < 0 for d in shape) or math.prod(shape) != arr.size:
        raise InvalidArgumentError(
            f"{field}: shape {list(shape)} does not match {arr.size} elements"
        )
    if shape != arr.shape:
        arr = arr.reshape(shape)
    if _LITTLE_ENDIAN:  # the wire's byte order is this host's: nothing to convert
        return arr
    return arr.astype(arr.dtype.newbyteorder("="), copy=False)
