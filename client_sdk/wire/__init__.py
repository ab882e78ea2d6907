"""What both ends of treadle's gRPC wire agree on, beyond the protos: how a tensor
is packed, the metadata keys a call and its answer carry, the message size limit.

Public, unlike the SDK's ``_`` modules, because the server imports it too (the
server may use the SDK's public surface, never its private modules), and a client
in another language is written against the same keys and packing. It needs only
grpcio, protobuf and numpy, so the SDK stays installable without the server.

- ``treadle.wire.tensors``: numpy arrays <-> the wire's ``Tensor``
- ``treadle.wire.metadata``: metadata keys, request ids, errors as trailers and back
- ``treadle.wire.channel``: the message size limit and the channel options
"""
