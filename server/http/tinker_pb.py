"""The tinker SDK's protobuf messages, from our own definition (tinker_public.proto).

Loaded into a private descriptor pool: a process that also imports the ``tinker``
SDK (tests, a notebook next to an embedded server) registers the SDK's own
``tinker_public.proto`` in the default pool, and two files of one name there
collide. The message classes are built at import and used like generated ones.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from treadle.server.http.tinker_public_descriptor import SERIALIZED

_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(descriptor_pb2.FileDescriptorProto.FromString(SERIALIZED))


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"tinker_public.{name}"))


ForwardBackwardRequest: Any = _message("ForwardBackwardRequest")
ForwardBackwardOutput: Any = _message("ForwardBackwardOutput")
SampleResponse: Any = _message("SampleResponse")
Tensor: Any = _message("Tensor")
BatchedTensor: Any = _message("BatchedTensor")

STOP_REASON_STOP = 0
STOP_REASON_LENGTH = 1
DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
DTYPE_INT32 = 3
DTYPE_BFLOAT16 = 4
