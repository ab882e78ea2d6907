"""The operator's view of a distributed deployment, from what the workers report
with their heartbeats: the worker that hosts a tenant's LoRA model reports its
device, its memory, the model and the adapter it holds, and the calls of that
tenant waiting in its scheduler (here on a missing ``seq_id``) with its own
fair-share deficit; the server's operator page shows them."""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any

import grpc
import pytest

from tests.helpers import char_ids, next_token_datum
from treadle import _convert
from treadle.server.console import views
from treadle.v1 import training_pb2, training_pb2_grpc

from .cluster import BASE, Cluster

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

TIMEOUT = 120


class _Bearer(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, key: str) -> None:
        self.key = key

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {self.key}")]
        return continuation(details._replace(metadata=metadata), request)


def test_the_workers_heartbeats_carry_the_queue_and_what_they_hold(cluster: Cluster) -> None:
    c = cluster
    service = c.client("carol")
    model_id = service.create_lora_training_client(BASE, rank=4, seed=0).model_id
    host = c.worker_of(model_id)
    assert c.server.ctx is not None
    channel = grpc.intercept_channel(
        grpc.insecure_channel(c.server.address), _Bearer(c.keys["carol"])
    )
    stub = training_pb2_grpc.TrainingServiceStub(channel)

    def fb(seq: int) -> Any:
        req = training_pb2.ForwardBackwardRequest(
            model_id=model_id, seq_id=seq, loss_fn=_convert.loss_fn_to_wire("cross_entropy")
        )
        req.data.extend(_convert.datums_to_wire([next_token_datum(char_ids("1+1=2"))]))
        return stub.ForwardBackward.future(req, timeout=TIMEOUT)

    waiting = [fb(seq) for seq in (2, 3, 4)]  # seq_id 1 missing: all three wait on the worker
    try:
        deadline = time.monotonic() + 60
        while True:
            page = views.operator(c.server.ctx)
            [worker] = [w for w in page["workers"] if w["id"] == host]
            queue = {q["tenant"]: q for q in page["queue"]}
            if "carol" in queue and queue["carol"]["waiting"] == 3:
                break
            assert time.monotonic() < deadline, (worker, page["queue"], c.log_tail())
            time.sleep(0.25)
        table = _admin_workers(c.database_url)  # the admin CLI reads the same reports
        (line,) = [ln.split() for ln in table.splitlines() if ln.startswith(host)]
        header = table.splitlines()[0].split()
        assert [h for h in header if h in ("device", "memory", "adapters", "waiting")] == [
            "device",
            "memory",
            "adapters",
            "waiting",
        ]
        assert "cpu" in line and "GiB" in line, line
        assert line[-3] == "3", line  # waiting, then the heartbeat's date and time
    finally:
        fb(1).result()  # the gap closes: every waiting call runs
        for f in waiting:
            f.result()
        channel.close()
    assert worker["device"] == "cpu"
    assert "used" in worker["memory"] and "free of" in worker["memory"]
    # what the engine holds is what the servers placed there (carol's LoRA model, and
    # those of the tests before)
    assert worker["loaded"] == worker["placed"] >= 1
    assert 1 <= worker["adapters"] <= worker["loaded"]
    carol = queue["carol"]
    assert carol["in_flight"] == 3  # admitted by the server, not finished
    assert carol["running"] == 0
    # only the worker that holds carol's model has her calls: its deficit, no other's
    assert [d["worker"] for d in carol["deficits"]] == [host]
    assert isinstance(carol["deficits"][0]["value"], int)
    # the other worker of the cluster reports too (its device and memory), with no
    # call of carol's
    others = [w for w in page["workers"] if w["id"] != host and w["status"] == "live"]
    assert others and all(w["device"] == "cpu" and w["memory"] for w in others)


def _admin_workers(database_url: str) -> str:
    from treadle.server.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["admin", "--database-url", database_url, "list-workers"]) == 0
    return out.getvalue()
