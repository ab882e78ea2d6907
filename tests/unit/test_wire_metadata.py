"""An error the server writes as trailers (``error_trailers``) reads back in the SDK
(``error_from_trailers``) as the same class with the same retry delay: the two
halves live in one public module (``treadle.wire.metadata``), and this pins them to
each other. Pure, no server."""

from __future__ import annotations

import treadle
from treadle.wire.metadata import (
    INSTANCE_KEY,
    RETRY_AFTER_KEY,
    error_from_trailers,
    error_trailers,
)


def test_a_quota_refusal_reads_back_with_its_delay_and_the_answering_instance() -> None:
    err = treadle.ResourceExhaustedError("over the token quota", retry_after_s=1.25)
    trailers = error_trailers(err, "inst-1")
    assert dict(trailers) == {RETRY_AFTER_KEY: "1.250", INSTANCE_KEY: "inst-1"}
    back = error_from_trailers(err.code, err.message, trailers)
    assert type(back) is treadle.ResourceExhaustedError
    assert (back.message, back.retry_after_s) == ("over the token quota", 1.25)


def test_an_error_without_extras_writes_no_trailers_and_reads_back_by_its_code() -> None:
    err = treadle.NotFoundError("model m-1 not found")
    assert error_trailers(err) == ()
    back = error_from_trailers(err.code, err.message, ())
    assert type(back) is treadle.NotFoundError and back.retry_after_s is None
