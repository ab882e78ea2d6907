"""Every RPC the server offers, found from the generated descriptors (so a method
added to a proto later is walked too), and a way to call any of them raw."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message

import treadle.v1


def all_methods() -> list[MethodDescriptor]:
    methods: list[MethodDescriptor] = []
    for info in pkgutil.iter_modules(treadle.v1.__path__):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"treadle.v1.{info.name}")
            for service in module.DESCRIPTOR.services_by_name.values():
                methods.extend(service.methods)
    return methods


def request_class(method: MethodDescriptor) -> type[Message]:
    return message_factory.GetMessageClass(method.input_type)


def call_raw(
    channel: grpc.Channel,
    method: MethodDescriptor,
    request: Message | bytes,
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float = 60.0,
) -> tuple[grpc.StatusCode, str, list[Any]]:
    """Call ``method`` with ``request``; its status code, details and responses.

    ``request`` may be raw bytes (the fuzzer's malformed messages), sent as they are."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    response = message_factory.GetMessageClass(method.output_type)
    args: dict[str, Any] = {
        "request_serializer": (
            (lambda b: b) if isinstance(request, bytes) else type(request).SerializeToString
        ),
        "response_deserializer": response.FromString,
    }
    try:
        if method.client_streaming and method.server_streaming:
            out = list(
                channel.stream_stream(path, **args)(
                    iter([request]), metadata=metadata, timeout=timeout
                )
            )
        elif method.client_streaming:
            out = [
                channel.stream_unary(path, **args)(
                    iter([request]), metadata=metadata, timeout=timeout
                )
            ]
        elif method.server_streaming:
            out = list(
                channel.unary_stream(path, **args)(request, metadata=metadata, timeout=timeout)
            )
        else:
            out = [channel.unary_unary(path, **args)(request, metadata=metadata, timeout=timeout)]
    except grpc.RpcError as err:
        return err.code(), err.details() or "", []
    return grpc.StatusCode.OK, "", out
