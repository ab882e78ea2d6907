"""A model that would not fit the worker's free memory is refused through the SDK
(RESOURCE_EXHAUSTED, the bytes needed and free), and the worker keeps serving
the models it has. The memory reading is injected (the embedded engine runs in
this process)."""

from __future__ import annotations

from pathlib import Path

import pytest

import treadle
from tests.conftest import make_server
from treadle.workers.device import memory_budget


def test_a_model_too_big_for_the_memory_is_refused_and_the_others_serve(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = make_server(tmp_path, {"tiny": tiny_model_dir})
    client = treadle.ServiceClient(srv.address, api_key=srv.api_key)
    try:
        first = client.create_lora_training_client("tiny", rank=4)
        datum = treadle.Datum(
            model_input=treadle.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
        )
        before = first.forward_logprobs([datum]).result(timeout=60).loss_fn_outputs[0].logprobs

        monkeypatch.setattr(memory_budget, "free_bytes", lambda device: 1024)
        with pytest.raises(treadle.errors.ResourceExhaustedError) as info:
            client.create_training_client("tiny")  # a full fine-tune: a copy of every weight
        assert "MiB" in info.value.message and "free" in info.value.message

        # the worker keeps serving the model it had
        first.forward_backward([datum], "cross_entropy").result(timeout=60)
        first.optim_step(treadle.AdamParams(learning_rate=1e-2)).result(timeout=60)
        after = first.forward_logprobs([datum]).result(timeout=60).loss_fn_outputs[0].logprobs
        assert after.sum() > before.sum()  # trained on: the target got likelier

        monkeypatch.undo()  # memory freed: the same request succeeds
        second = client.create_training_client("tiny")
        second.forward_logprobs([datum]).result(timeout=60)
    finally:
        client.close()
        srv.stop()
