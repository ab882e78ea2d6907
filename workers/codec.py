"""Bytes-safe encoding of what crosses the Celery transport: the domain
dataclasses, numpy arrays and treadle errors, as msgpack.

Celery's JSON cannot carry bytes, and pickle would let one tenant's payload run
code in a worker that serves every tenant. msgpack carries bytes natively; the
three extension types below are the only things besides plain values it will
rebuild, and a dataclass is rebuilt only if it is one of ``treadle.workers.domain``'s
(an allow-list made from that module, so a new domain type is covered by itself).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from treadle.errors import InternalError, TreadleError, error_for_code
from treadle.workers import domain

_NDARRAY, _DATACLASS, _ERROR = 1, 2, 3

#: name -> class of every dataclass defined in treadle.workers.domain
DOMAIN_TYPES: Mapping[str, type] = {
    name: cls
    for name, cls in inspect.getmembers(domain, inspect.isclass)
    if dataclasses.is_dataclass(cls) and cls.__module__ == domain.__name__
}


class CodecError(ValueError):
    """A payload that is not a treadle message (or names an unknown type)."""


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise CodecError("cannot encode an object array")
        arr = np.ascontiguousarray(obj)
        return msgpack.ExtType(
            _NDARRAY, msgpack.packb((arr.dtype.str, arr.shape, arr.tobytes()), use_bin_type=True)
        )
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if DOMAIN_TYPES.get(name) is not type(obj):
            raise CodecError(f"cannot encode {type(obj).__qualname__}: not a domain type")
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(_DATACLASS, _pack((name, fields)))
    if isinstance(obj, BaseException):
        err = (
            obj if isinstance(obj, TreadleError) else InternalError(f"{type(obj).__name__}: {obj}")
        )
        return msgpack.ExtType(_ERROR, _pack((err.code, err.message, err.retry_after_s)))
    if isinstance(obj, Mapping):
        return dict(obj)
    raise CodecError(f"cannot encode {type(obj).__qualname__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _NDARRAY:
        dtype, shape, raw = msgpack.unpackb(data, raw=False, use_list=False)
        # a copy: frombuffer's view is read-only and torch warns on it
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == _DATACLASS:
        name, fields = _unpack(data)
        cls = DOMAIN_TYPES.get(name)
        if cls is None:
            raise CodecError(f"unknown domain type {name!r}")
        return cls(**fields)
    if code == _ERROR:
        code_name, message, retry_after = _unpack(data)
        return error_for_code(code_name, message, retry_after)
    raise CodecError(f"unknown extension type {code}")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(
        data, ext_hook=_ext_hook, raw=False, use_list=False, strict_map_key=False
    )


def encode(obj: Any) -> bytes:
    """Plain values, tuples (lists come back as tuples), dicts, numpy arrays,
    domain dataclasses and exceptions (as treadle errors) -> bytes."""
    return _pack(obj)


def decode(data: bytes) -> Any:
    try:
        return _unpack(data)
    except CodecError:
        raise
    except Exception as err:
        raise CodecError(f"not a treadle message: {type(err).__name__}: {err}") from None
