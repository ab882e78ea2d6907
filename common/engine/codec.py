"""Bytes-safe encoding of what crosses the Celery transport: the domain
dataclasses, numpy arrays and treadle errors, as msgpack.

Celery's JSON cannot carry bytes, and pickle would let one tenant's payload run
code in a worker that serves every tenant. msgpack carries bytes natively; the
three extension types below are the only things besides plain values it will
rebuild, and a dataclass is rebuilt only if it is one of ``treadle.common.engine.domain``'s
(an allow-list made from that module, so a new domain type is covered by itself)
or one of ``treadle.common.engine.messages``'s.

A message between a server and a worker (``encode_message``) is framed with the
message format's version ahead of the message itself: the version is read and
checked first, so a peer of another version is refused by name, whatever its
messages hold.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from treadle.common.engine import domain
from treadle.common.engine import messages as engine_messages
from treadle.errors import InternalError, InvalidArgumentError, TreadleError, error_for_code

_NDARRAY, _DATACLASS, _ERROR = 1, 2, 3

#: name -> class of every dataclass defined in treadle.common.engine.domain
DOMAIN_TYPES: Mapping[str, type] = {
    name: cls
    for name, cls in inspect.getmembers(domain, inspect.isclass)
    if dataclasses.is_dataclass(cls) and cls.__module__ == domain.__name__
}

#: every dataclass this codec rebuilds: the domain's and the engine messages'
ALLOWED_TYPES: Mapping[str, type] = {**DOMAIN_TYPES, **engine_messages.MESSAGES}


class CodecError(InvalidArgumentError, ValueError):
    """A payload that is not a treadle message, names an unknown type, or is of
    another message version (INVALID_ARGUMENT where it is answered)."""


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
        if ALLOWED_TYPES.get(name) is not type(obj):
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
        cls = ALLOWED_TYPES.get(name)
        if cls is None:
            raise CodecError(f"unknown domain type {name!r}")
        return cls(**fields)
    if code == _ERROR:
        code_name, message, retry_after = _unpack(data)
        return error_for_code(code_name, message, retry_after)
    raise CodecError(f"unknown extension type {code}")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(data: bytes | memoryview) -> Any:
    return msgpack.unpackb(
        data, ext_hook=_ext_hook, raw=False, use_list=False, strict_map_key=False
    )


def encode(obj: Any) -> bytes:
    """Plain values, tuples (lists come back as tuples), dicts, numpy arrays,
    domain dataclasses and exceptions (as treadle errors) -> bytes."""
    return _pack(obj)


def decode(data: bytes | memoryview) -> Any:
    try:
        return _unpack(data)
    except CodecError:
        raise
    except Exception as err:
        raise CodecError(f"not a treadle message: {type(err).__name__}: {err}") from None


def encode_message(msg: Any) -> bytes:
    """An engine message (a request, or a ``Reply``), framed with ``VERSION``."""
    if engine_messages.MESSAGES.get(type(msg).__name__) is not type(msg):
        raise CodecError(f"{type(msg).__qualname__} is not an engine message")
    return _pack(engine_messages.VERSION) + _pack(msg)


def decode_message(data: bytes, expect: tuple[type, ...]) -> Any:
    """The message framed in ``data``; a message of another version, or not one of
    ``expect`` (the request types, or ``Reply``), is refused with a CodecError."""
    head = msgpack.Unpacker(raw=False)
    head.feed(data[:9])  # an int's msgpack form is at most 9 bytes
    try:
        version = next(head)
    except Exception:  # cut short, or a first object longer than an int
        version = None
    if not isinstance(version, int) or isinstance(version, bool):
        raise CodecError("not a treadle message: it carries no message version")
    if version != engine_messages.VERSION:
        raise CodecError(
            f"message version {version}, but this side speaks version "
            f"{engine_messages.VERSION}: run the server and its workers at the same release"
        )
    msg = decode(memoryview(data)[head.tell() :])  # no copy of the body
    if not isinstance(msg, expect):
        raise CodecError(
            f"unexpected message {type(msg).__name__}; expected one of "
            + ", ".join(t.__name__ for t in expect)
        )
    return msg
