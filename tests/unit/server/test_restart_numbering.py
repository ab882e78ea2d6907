"""When a restarted server refuses a call at once (``server.restarts``), and how
the SDK reads the refusal back (``treadle.wire.metadata``): pure, no server."""

from __future__ import annotations

import pytest

import treadle
from treadle.common.engine.domain import ModelStatus
from treadle.errors import error_for_code
from treadle.server.restarts import RestorePoint, check_numbering
from treadle.wire.metadata import (
    FIRST_PENDING_KEY,
    INSTANCE_KEY,
    error_from_trailers,
    error_trailers,
)

NOW = "new-instance"
RESTORED = {"m": RestorePoint(seq_id=3, step=1, checkpoint="treadle://m/state/s1")}


def _check(seen: str, first: int, seq_id: int, next_seq_id: int = 4) -> None:
    md = [(INSTANCE_KEY, seen), (FIRST_PENDING_KEY, str(first))] if seen else []
    status = ModelStatus(model_id="m", version=1, next_seq_id=next_seq_id, last_checkpoint_seq_id=3)
    check_numbering(NOW, RESTORED, md, "m", seq_id, lambda: status)


def test_a_gap_no_pending_call_can_fill_is_refused_at_once() -> None:
    with pytest.raises(treadle.ServerRestartedError) as caught:
        _check("old-instance", first=7, seq_id=8)
    err = caught.value
    assert (err.model_id, err.step, err.seq_id, err.next_seq_id) == ("m", 1, 3, 4)
    assert err.checkpoint == "treadle://m/state/s1"
    assert "resync()" in err.message and "seq_ids 4..6" in err.message


@pytest.mark.parametrize(
    ("seen", "first", "seq_id", "next_seq_id"),
    [
        ("", 7, 8, 4),  # a client that does not say (another SDK): the gap timeout rules
        (NOW, 7, 8, 4),  # numbered against this instance: an ordinary gap
        ("old-instance", 4, 5, 4),  # its own pending call 4 fills the gap (graceful stop)
        ("old-instance", 4, 5, 5),  # ... and was applied already
        ("old-instance", 7, 7, 7),  # the model went on here up to the client's numbering
    ],
)
def test_calls_that_can_still_be_applied_in_order_pass(
    seen: str, first: int, seq_id: int, next_seq_id: int
) -> None:
    _check(seen, first, seq_id, next_seq_id)


def test_a_model_not_restored_here_is_never_checked() -> None:
    status = ModelStatus(model_id="x", version=0, next_seq_id=1, last_checkpoint_seq_id=0)
    md = [(INSTANCE_KEY, "old-instance"), (FIRST_PENDING_KEY, "9")]
    check_numbering(NOW, RESTORED, md, "x", 9, lambda: status)


def test_the_sdk_reads_the_kind_and_fields_back_from_the_trailers() -> None:
    with pytest.raises(treadle.ServerRestartedError) as caught:
        _check("old-instance", first=7, seq_id=7)
    trailers = dict(error_trailers(caught.value, NOW))
    assert trailers[INSTANCE_KEY] == NOW
    # what the SDK's error_from_rpc does with them
    back = error_from_trailers("ABORTED", caught.value.message, trailers.items())
    assert isinstance(back, treadle.ServerRestartedError)
    assert (back.model_id, back.step, back.seq_id, back.checkpoint) == (
        "m",
        1,
        3,
        "treadle://m/state/s1",
    )
    # an ABORTED of another kind stays a plain AbortedError
    plain = error_for_code("ABORTED", "gap")
    assert type(plain) is treadle.AbortedError
