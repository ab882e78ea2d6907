"""A worker killed (SIGKILL) in the middle of a ``save_state``, for real: the
worker talks to S3 through a proxy that freezes the upload once about half of
the checkpoint's bytes have gone, and the worker is killed right then. No
half-written checkpoint is ever listed or loaded (the manifest goes last); the
save fails UNAVAILABLE; the model comes back at its last applied step on a live
worker; the SDK's repeat of the save, sent before the model's next call, saves
it whole there, and it loads at that step with the same logprobs."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import boto3
import numpy as np
import pytest

import treadle
from treadle.errors import NotFoundError, UnavailableError

from .cluster import BASE, Cluster, datum, one_more_worker, placed_on
from .freezing_proxy import FreezingProxy

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _objects(c: Cluster, tenant_id: str, model_id: str, name: str) -> dict[str, int]:
    """The S3 objects of a checkpoint: file name -> size."""
    bucket, _, prefix = c.store.removeprefix("s3://").partition("/")
    key = "/".join(p for p in (prefix, tenant_id, model_id, name) if p)
    s3 = boto3.client("s3", endpoint_url=c.s3_endpoint)
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{key}/").get("Contents", [])
    return {o["Key"].rsplit("/", 1)[1]: int(o["Size"]) for o in listed}


def test_a_worker_killed_mid_save_lists_no_half_checkpoint(
    cluster: Cluster, tmp_path: Path
) -> None:
    c = cluster
    proxy = FreezingProxy(int(c.s3_endpoint.rsplit(":", 1)[1]))
    try:
        doomed = one_more_worker(c, "w7", tmp_path, drain_timeout_s=0.0, s3_endpoint=proxy.url)
        alice = c.client("alice", max_retries=0)  # the failure shows, as it happens
        tok = alice.get_tokenizer(BASE)
        data = [datum(tok.encode("12+3=15")), datum(tok.encode("7+8=15"))]
        probe = [datum(tok.encode("4+4=8"))]
        adam = treadle.AdamParams(learning_rate=1e-2)
        tc = placed_on(c, alice, doomed, 71)
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam).result()
        first = tc.save_state("s1").result()  # whole: the proxy is not armed yet
        ((tenant_id,),) = c.sql("SELECT tenant_id FROM models WHERE id = :m", m=tc.model_id)
        whole = _objects(c, str(tenant_id), tc.model_id, "s1")
        assert "manifest.json" in whole and len(whole) >= 3, whole
        tc.forward_backward(data, "cross_entropy").result()
        assert tc.optim_step(adam).result().step == 2
        logprobs = tc.forward_logprobs(probe).result().loss_fn_outputs[0].logprobs

        proxy.arm(sum(whole.values()) // 2)  # half of a checkpoint's bytes, then nothing
        fut = tc.save_state("s2")
        assert proxy.frozen.wait(60), "the save never uploaded half of its bytes"
        c.workers[doomed].send_signal(signal.SIGKILL)
        c.workers[doomed].wait(10)
        with pytest.raises(UnavailableError):
            fut.result(timeout=60)

        # what the kill left: no s2 listed, none to load, no manifest in the bucket
        assert [ck.name for ck in tc.list_checkpoints()] == ["s1"]
        half = _objects(c, str(tenant_id), tc.model_id, "s2")
        assert "manifest.json" not in half, half
        with pytest.raises(NotFoundError):
            alice.create_training_client_from_state(first.path.replace("/s1", "/s2"))
        assert c.sql(
            "SELECT count(*) FROM checkpoints WHERE model_id = :m AND name = 's2'", m=tc.model_id
        ) == [(0,)]

        ops = "SELECT kind, status FROM ops WHERE model_id = :m AND kind = 'save_state' ORDER BY seq_id"
        # the next call carries the SDK's repeat of the save: the model comes back
        # at step 2 on a live worker, and the save lands there whole
        again = tc.forward_logprobs(probe).result().loss_fn_outputs[0].logprobs
        np.testing.assert_array_equal(again, logprobs)
        assert c.worker_of(tc.model_id) not in ("", doomed)
        # (the repeat's answer goes nowhere: the server lists the save once it has it)
        deadline = time.monotonic() + 30
        while (names := sorted(ck.name for ck in tc.list_checkpoints())) != ["s1", "s2"]:
            assert time.monotonic() < deadline, (names, c.sql(ops, m=tc.model_id))
            time.sleep(0.2)
        saved = _objects(c, str(tenant_id), tc.model_id, "s2")
        assert saved.keys() == whole.keys(), (saved, whole)
        copy = alice.create_training_client_from_state(first.path.replace("/s1", "/s2"))
        assert copy.get_info().version == 2
        loaded = copy.forward_logprobs(probe).result().loss_fn_outputs[0].logprobs
        np.testing.assert_array_equal(loaded, logprobs)
        saves = c.sql(ops, m=tc.model_id)
        assert saves == [("save_state", "done"), ("save_state", "done")], saves
    finally:
        proxy.close()
