"""gRPC reflection serves the wire contract to clients in any language: a generic
client that has no treadle stubs (what grpcurl or a dynamic-language client does)
lists the services, builds the message types from the server's descriptors, and
calls a method with them."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from treadle.server.embedded import EmbeddedServer

TREADLE_SERVICES = {
    "treadle.v1.TrainingService",
    "treadle.v1.SamplingService",
    "treadle.v1.ServerService",
    "treadle.v1.SessionService",
}


def test_reflection_lists_services_and_a_generic_client_calls_one(
    server: EmbeddedServer,
) -> None:
    with grpc.insecure_channel(server.address) as channel:
        # Reflection needs no API key (it reveals only the public contract).
        reflection_db = ProtoReflectionDescriptorDatabase(channel)
        services = set(reflection_db.get_services())
        assert services >= TREADLE_SERVICES | {"grpc.health.v1.Health"}, services

        # A pool fed only by reflection: no treadle.v1 module is used from here on.
        pool = descriptor_pool.DescriptorPool(reflection_db)
        service = pool.FindServiceByName("treadle.v1.ServerService")
        method = service.methods_by_name["GetServerInfo"]
        assert method.input_type.full_name == "treadle.v1.GetServerInfoRequest"
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary(
            f"/{service.full_name}/{method.name}",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        info = call(request_cls(), metadata=(("authorization", f"Bearer {server.api_key}"),))
        assert info.DESCRIPTOR.full_name == "treadle.v1.ServerInfo"
        assert info.api_version == "treadle.v1"
        assert [m.name for m in info.base_models] == ["tiny"]

        # The reflected descriptors carry field numbers a dynamic client relies on.
        sampling = pool.FindMessageTypeByName("treadle.v1.SamplingParams")
        assert sampling.fields_by_name["top_k"].number == 4
