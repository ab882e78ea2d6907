"""The auto-checkpoint policy: a restart brings a model back at its last auto checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import treadle
from tests.conftest import make_server
from tests.helpers import next_token_datum


def test_restart_returns_to_last_auto_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> None:
    datum = next_token_datum([1, 20, 21, 14, 22, 2])
    srv = make_server(tmp_path, {"tiny": tiny_model_dir}, auto_checkpoint_steps=2)
    try:
        client = treadle.ServiceClient(srv.address, api_key=getattr(srv, "api_key", None))
        trainer = client.create_lora_training_client("tiny", rank=4)
        seqs = []
        for _ in range(3):  # seq ids 1..6; optimizer steps at seq 2, 4, 6
            trainer.forward_backward([datum]).result()
            seqs.append(trainer.optim_step(treadle.AdamParams(learning_rate=1e-2)).result().step)
        assert seqs == [1, 2, 3]
        at_step_2 = trainer.forward_logprobs([datum]).result()  # seq 7: weights after step 3
        info = trainer.get_info()
        assert info.last_checkpoint_seq_id == 4  # the optim_step that made step 2
        model_id = trainer.model_id
        client.close()
    finally:
        srv.stop()

    srv = make_server(tmp_path, {"tiny": tiny_model_dir}, auto_checkpoint_steps=2)
    try:
        client = treadle.ServiceClient(srv.address, api_key=getattr(srv, "api_key", None))
        trainer = client.get_training_client(model_id)
        info = trainer.get_info()
        assert info.version == 2
        assert info.last_checkpoint_seq_id == 4
        assert info.next_seq_id == 5
        # Replaying step 3 from the checkpoint lands on the same weights as before.
        trainer.forward_backward([datum]).result()
        assert trainer.optim_step(treadle.AdamParams(learning_rate=1e-2)).result().step == 3
        again = trainer.forward_logprobs([datum]).result()
        np.testing.assert_allclose(
            again.loss_fn_outputs[0].logprobs, at_step_2.loss_fn_outputs[0].logprobs, atol=1e-6
        )
        client.close()
    finally:
        srv.stop()
