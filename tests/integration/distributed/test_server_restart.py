"""The server restarted under a distributed deployment: the models stay on
their live workers and carry on where they were."""

from __future__ import annotations

import numpy as np
import pytest

import treadle
from treadle.server.embedded import EmbeddedServer

from .cluster import BASE, Cluster, datum

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_server_restart_adopts_models(cluster: Cluster) -> None:
    """The server restarts; the models stay on their live workers and carry on
    where they were (same worker, same step, same seq_id), not from a checkpoint."""
    c = cluster
    alice = c.client("alice")
    tok = alice.get_tokenizer(BASE)
    data = [datum(tok.encode("12+3=15"))]
    tc = alice.create_lora_training_client(BASE, rank=4, seed=21)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result()
    before = tc.forward_logprobs(data).result().loss_fn_outputs[0].logprobs
    worker = c.worker_of(tc.model_id)
    config = c.server.config
    c.server.stop()
    c.server = EmbeddedServer(config).start()
    again = c.client("alice").get_training_client(tc.model_id)
    info = again.get_info()
    assert info.status == "active" and info.version == 1
    assert c.worker_of(tc.model_id) == worker
    after = again.forward_logprobs(data).result().loss_fn_outputs[0].logprobs
    np.testing.assert_array_equal(before, after)
    again.forward_backward(data, "cross_entropy").result()
    assert again.optim_step(treadle.AdamParams(learning_rate=1e-2)).result().step == 2
