"""S3 unreachable during a save, for real: an embedded server whose checkpoint
store is a moto S3 server on a fixed loopback port, stopped and started again
(empty, as moto keeps nothing) by the test. The save fails cleanly (UNAVAILABLE,
nothing listed, the model untouched); the SDK sends the failed save again before
the model's next call, and with S3 back that repeat uploads the state the save
took (the engine does not save twice): listed then, complete, and it loads at
the step it was taken. A save after that works as ever."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.conftest import make_server
from tests.integration.distributed.cluster import datum as _datum
from tests.integration.services import S3_ENV, _moto_server, free_port, start_listening
from treadle.errors import TreadleError

BUCKET = "faults"


class Moto:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import boto3

        argv = [_moto_server(), "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = start_listening(argv, self.port, "moto")
        boto3.client("s3", endpoint_url=self.url).create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture(scope="module")
def moto() -> Iterator[Moto]:
    import os

    for key, value in S3_ENV.items():
        os.environ.setdefault(key, value)
    m = Moto()
    m.start()
    try:
        yield m
    finally:
        m.stop()


def test_s3_unreachable_during_a_save(moto: Moto, tiny_model_dir: Path, tmp_path: Path) -> None:
    server = make_server(
        tmp_path, {"tiny": tiny_model_dir}, store=f"s3://{BUCKET}/c", s3_endpoint_url=moto.url
    )
    try:
        service = treadle.ServiceClient(server.address, api_key=server.api_key, max_retries=1)
        tok = service.get_tokenizer("tiny")
        data = [_datum(tok.encode("12+3=15"))]
        adam = treadle.AdamParams(learning_rate=1e-2)
        tc = service.create_lora_training_client("tiny", rank=4, seed=3)
        tc.forward_backward(data, "cross_entropy").result()
        assert tc.optim_step(adam).result().step == 1
        before = tc.forward_logprobs(data).result().loss_fn_outputs[0].logprobs

        moto.stop()
        try:
            with pytest.raises(TreadleError) as caught:
                tc.save_state("during").result(timeout=120)
        finally:
            moto.start()  # back, empty
        assert caught.value.code == "UNAVAILABLE", caught.value
        assert "during" not in [c.name for c in tc.list_checkpoints()]

        # the model is untouched; its next call brings the failed save's upload along
        after = tc.forward_logprobs(data).result().loss_fn_outputs[0].logprobs
        np.testing.assert_array_equal(before, after)
        deadline = time.monotonic() + 60  # the repeat's answer goes to no caller: look
        while not (found := [c for c in tc.list_checkpoints() if c.name == "during"]):
            assert time.monotonic() < deadline, "the failed save was never uploaded"
            time.sleep(0.2)
        (during,) = found
        restored = service.create_training_client_from_state(during.path)
        assert restored.get_info().version == 1
        np.testing.assert_array_equal(
            restored.forward_logprobs(data).result().loss_fn_outputs[0].logprobs, before
        )
        tc.forward_backward(data, "cross_entropy").result()
        assert tc.optim_step(adam).result().step == 2
        saved = tc.save_state("after").result()
        names = [c.name for c in tc.list_checkpoints()]
        assert sorted(names) == ["after", "during"], names
        copy = service.create_training_client_from_state(saved.path)
        assert copy.get_info().version == 2
        np.testing.assert_array_equal(
            copy.forward_logprobs(data).result().loss_fn_outputs[0].logprobs,
            tc.forward_logprobs(data).result().loss_fn_outputs[0].logprobs,
        )
        service.close()
    finally:
        server.stop()
