"""A training run's ``user_metadata``: the caller's own string notes on the run
(the tinker SDK's ``CreateModelRequest.user_metadata``, read back as
``TrainingRun.user_metadata``; treadle's ``CreateModel`` takes the same map).

One check for both transports, so a map one refuses the other refuses too, with
the same message naming the field and the limit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from treadle.errors import InvalidArgumentError

MAX_KEYS = 64
MAX_KEY_CHARS = 128
MAX_VALUE_CHARS = 4096
#: the whole map as JSON, in bytes
MAX_TOTAL_BYTES = 16 * 1024


def check(raw: object, field: str = "user_metadata") -> dict[str, str]:
    """``raw`` as the map kept for the run ({} for None); INVALID_ARGUMENT naming
    the field when it is not an object of strings within the limits."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InvalidArgumentError(f"{field}: expected an object of string values")
    if len(raw) > MAX_KEYS:
        raise InvalidArgumentError(f"{field}: {len(raw)} keys; at most {MAX_KEYS}")
    out: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"{field}: keys are non-empty strings (got {key!r})")
        if len(key) > MAX_KEY_CHARS:
            raise InvalidArgumentError(
                f"{field}: key {key[:32]!r}... has {len(key)} characters; at most {MAX_KEY_CHARS}"
            )
        if not isinstance(value, str):
            raise InvalidArgumentError(
                f"{field}.{key}: expected a string, got {type(value).__name__} "
                "(store numbers and objects as their JSON text)"
            )
        if len(value) > MAX_VALUE_CHARS:
            raise InvalidArgumentError(
                f"{field}.{key}: {len(value)} characters; at most {MAX_VALUE_CHARS}"
            )
        out[key] = value
    size = len(json.dumps(out, ensure_ascii=False).encode())
    if size > MAX_TOTAL_BYTES:
        raise InvalidArgumentError(f"{field}: {size} bytes as JSON; at most {MAX_TOTAL_BYTES}")
    return out
