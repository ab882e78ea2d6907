"""The sampling request's own limits, checked where a transport reads the
request (both answer INVALID_ARGUMENT / 400 naming the field and the limit) and
again by every sampler backend: a request is never shipped to an engine with a
megabyte of stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence

from treadle.errors import InvalidArgumentError

#: stop strings in one request (vLLM and tinker take a handful; 32 is plenty)
MAX_STOP_STRINGS = 32
#: characters in one stop string
MAX_STOP_STRING_CHARS = 256
#: stop token ids in one request
MAX_STOP_TOKEN_IDS = 256


def check_stop(strings: Sequence[str], token_ids: Sequence[int], field: str = "stop") -> None:
    """INVALID_ARGUMENT naming ``field`` and the limit it passes."""
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidArgumentError(
            f"{field}: {len(strings)} stop strings; at most {MAX_STOP_STRINGS}"
        )
    for i, s in enumerate(strings):
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidArgumentError(
                f"{field}: stop string {i} has {len(s)} characters; "
                f"1..{MAX_STOP_STRING_CHARS} are allowed"
            )
    if len(token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgumentError(
            f"{field}: {len(token_ids)} stop token ids; at most {MAX_STOP_TOKEN_IDS}"
        )
