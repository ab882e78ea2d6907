"""Small builders the tests share (one definition each)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import grpc

import treadle


def char_ids(text: str) -> list[int]:
    """``text`` in the tiny model's character ids (``workers.model.tiny``)."""
    return [3 + (ord(c) - 32) for c in text]


def next_token_datum(
    tokens: Sequence[int], weights: Sequence[float] | None = None
) -> treadle.Datum:
    """A datum that trains each token on the next one: inputs ``tokens[:-1]``,
    targets ``tokens[1:]``, weights 1 unless given."""
    tokens = [int(t) for t in tokens]
    n = len(tokens) - 1
    return treadle.Datum(
        model_input=treadle.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": list(weights) if weights is not None else [1.0] * n,
        },
    )


class _Auth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds an API key to raw calls (the SDK does this itself)."""

    def __init__(self, key: str | None) -> None:
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), *self.metadata])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


def raw_channel(server: Any) -> grpc.Channel:
    """A plain gRPC channel to an embedded ``server`` that sends its API key (or
    ``TREADLE_API_KEY``) with every call: for tests that send raw requests."""
    key = getattr(server, "api_key", None) or os.environ.get("TREADLE_API_KEY")
    return grpc.intercept_channel(grpc.insecure_channel(server.address), _Auth(key))
