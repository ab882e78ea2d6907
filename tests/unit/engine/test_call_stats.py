"""The engine's queue accounting behind ``treadle_queue_depth`` and
``treadle_queue_wait_seconds``, and the JSON log line, without a server."""

from __future__ import annotations

import json
import logging
import sys

from treadle.common.logs import JsonFormatter, request_context
from treadle.workers.engine.call_stats import WAIT_BUCKETS_S, CallStats


def test_a_call_counts_as_queued_until_it_starts_or_is_dropped() -> None:
    stats = CallStats()
    stats.queued("m1", 1, "alice", arrived_at=0.0)  # arrived long ago: a long wait
    stats.queued("m1", 2, "alice", arrived_at=0.0)
    stats.queued("m2", 1, "bob", arrived_at=0.0)
    assert stats.snapshot().queued == {"alice": 2, "bob": 1}

    stats.started("m1", 1)
    stats.dropped("m2", 1)  # timed out, deleted, ...: no wait recorded
    stats.started("m2", 1)  # already gone: nothing happens
    snap = stats.snapshot()
    assert snap.queued == {"alice": 1}
    assert set(snap.waits) == {"alice"}
    buckets = snap.waits["alice"].cumulative()
    assert len(buckets) == len(WAIT_BUCKETS_S) + 1
    assert buckets[-1] == ("+Inf", 1)
    assert buckets[-2][1] == 0  # it waited more than the largest bound
    assert snap.waits["alice"].total_s > WAIT_BUCKETS_S[-1]


def test_checkpoint_bytes_add_up() -> None:
    stats = CallStats()
    stats.checkpoint(100)
    stats.checkpoint(50)
    snap = stats.snapshot()
    assert (snap.checkpoints, snap.checkpoint_bytes) == (2, 150)


def test_a_json_line_has_the_request_id_extras_and_traceback() -> None:
    fmt = JsonFormatter("serve")
    record = logging.LogRecord("treadle.x", logging.ERROR, __file__, 1, "failed %s", ("a",), None)
    record.rpc = "TrainingService/OptimStep"
    with request_context("rid-1"):
        line = json.loads(fmt.format(record))
    assert line["request_id"] == "rid-1" and line["msg"] == "failed a"
    assert line["rpc"] == "TrainingService/OptimStep" and line["process"] == "serve"
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        record.exc_info = sys.exc_info()
    text = fmt.format(record)
    assert "\n" not in text  # one object a line, tracebacks included
    assert "boom" in json.loads(text)["exc"]
    assert "request_id" not in json.loads(text)  # outside the call's context
