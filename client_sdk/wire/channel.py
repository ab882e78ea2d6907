"""The gRPC channel settings both ends use: one message size limit, so what one end
may send the other may receive."""

from __future__ import annotations

from typing import Any

#: gRPC's 4 MB default is far too small for batches, tokenizers and checkpoints.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options of the SDK's channel and of the server (which ignores the reconnect ones)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # A restarted server is found within about a second of listening again: by
        # default gRPC waits up to 120 s between connection attempts, and every call
        # made meanwhile fails at once, spending the SDK's retries.
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 1_000),
    ]
