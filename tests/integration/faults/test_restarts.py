"""A restart of ``treadle serve`` is not a dead end for the client (issue 21, item 1).

Real processes: a ``treadle serve`` subprocess on a free port with a tiny model,
killed (``kill -9``) or stopped (SIGTERM) and started again on the same data
directory and port, driven by the SDK from this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.integration.services import free_port, port_open

TIMEOUT = 120
GAP_TIMEOUT_S = 60  # the default: no call may wait for it because of a restart


class Serve:
    """One ``treadle serve`` process at a time, on a fixed port and data directory."""

    def __init__(self, tmp: Path, model: Path, *extra: str) -> None:
        self.tmp, self.model, self.extra = tmp, model, extra
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.tmp / f"serve-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        cmd = [
            *(sys.executable, "-m", "treadle.server.cli", "serve", "--no-auth"),
            *("--model", f"tiny={self.model}", "--port", str(self.port), "--http-port", "-1"),
            *("--data-dir", str(self.tmp / "data"), "--threads", "1"),
            *("--gap-timeout", str(GAP_TIMEOUT_S), *self.extra),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + TIMEOUT
        while b"treadle: serving" not in self.log.read_bytes() or not port_open(
            "127.0.0.1", self.port
        ):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"treadle serve did not start:\n{self.log.read_text()}")
            time.sleep(0.1)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # kill -9: nothing is checkpointed
        self.proc.wait(30)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(TIMEOUT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@contextmanager
def serve(tmp: Path, model: Path, *extra: str) -> Iterator[Serve]:
    s = Serve(tmp, model, *extra)
    s.start()
    try:
        yield s
    finally:
        s.close()


def _data() -> list[treadle.Datum]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(3):
        tokens = [int(t) for t in rng.integers(3, 60, size=9)]
        out.append(
            treadle.Datum(
                model_input=treadle.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 8},
            )
        )
    return out


DATA = _data()
ADAM = treadle.AdamParams(learning_rate=5e-3)


def _step(tc: treadle.TrainingClient) -> int:
    fb = tc.forward_backward(DATA, "cross_entropy")
    opt = tc.optim_step(ADAM)
    fb.result(TIMEOUT)
    return opt.result(TIMEOUT).step


def _logprobs(tc: treadle.TrainingClient) -> np.ndarray:
    out = tc.forward_logprobs(DATA).result(TIMEOUT)
    return np.concatenate([np.asarray(o.logprobs) for o in out.loss_fn_outputs])


def test_kill_9_the_next_call_names_the_restart_at_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    with serve(tmp_path, tiny_model_dir) as srv:
        service = treadle.ServiceClient(srv.address, max_retries=10)
        tc = service.create_lora_training_client("tiny", rank=4, seed=0)
        assert _step(tc) == 1  # seq_ids 1, 2
        saved = tc.save_state("s1").result(TIMEOUT)  # seq_id 3
        assert (saved.seq_id, saved.step) == (3, 1)
        at_checkpoint = _logprobs(tc)  # seq_id 4
        assert _step(tc) == 2  # seq_ids 5, 6: answered, then lost with the kill
        before = service.server_instance
        assert before

        srv.kill()
        srv.start()
        t0 = time.monotonic()
        with pytest.raises(treadle.ServerRestartedError) as caught:
            tc.forward_backward(DATA).result(GAP_TIMEOUT_S / 3)  # seq_id 7
        waited = time.monotonic() - t0
        err = caught.value
        assert waited < 10, f"the restart took {waited:.1f}s to be told"
        assert isinstance(err, treadle.AbortedError)  # ABORTED on the wire
        assert (err.model_id, err.step, err.seq_id) == (tc.model_id, 1, 3)
        assert err.checkpoint == f"treadle://{tc.model_id}/state/s1"
        message = str(err)
        for part in ("restarted", tc.model_id, "step 1", "seq_id 3", "resync()", "state/s1"):
            assert part in message, message
        assert service.server_instance not in ("", before)

        assert tc.resync() == 4
        np.testing.assert_allclose(_logprobs(tc), at_checkpoint, atol=1e-6)  # seq_id 4
        assert _step(tc) == 2  # the loop goes on from the checkpoint
        service.close()


def test_auto_resync_replays_the_lost_calls_and_the_loop_goes_on(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    steps = 7
    with serve(tmp_path, tiny_model_dir) as srv:
        service = treadle.ServiceClient(srv.address, max_retries=10, auto_resync=True)
        # The same loop without a restart, for the numbers the restarted one must give.
        reference = service.create_lora_training_client("tiny", rank=4, seed=1)
        for _ in range(steps):
            _step(reference)
        expected = _logprobs(reference)

        tc = service.create_lora_training_client("tiny", rank=4, seed=1)
        for i in range(steps):
            if i == 2:
                tc.save_state("two").result(TIMEOUT)
            if i == 4:  # steps 3 and 4 were answered, and die with the server
                srv.kill()
                srv.start()
                t0 = time.monotonic()
                assert _step(tc) == i + 1
                assert time.monotonic() - t0 < 30  # replayed, not a gap timeout
            elif i == 6:  # killed with the step's calls in flight
                fb = tc.forward_backward(DATA, "cross_entropy")
                opt = tc.optim_step(ADAM)
                srv.kill()
                srv.start()
                fb.result(TIMEOUT)
                assert opt.result(TIMEOUT).step == i + 1
            else:
                assert _step(tc) == i + 1
        info = tc.get_info()
        assert (info.version, info.next_seq_id) == (steps, 2 * steps + 2)
        np.testing.assert_allclose(_logprobs(tc), expected, atol=1e-5)
        service.close()


def test_sigterm_checkpoints_every_model_no_step_lost(tmp_path: Path, tiny_model_dir: Path) -> None:
    k = 3
    with serve(tmp_path, tiny_model_dir) as srv:
        service = treadle.ServiceClient(srv.address, max_retries=10)
        tc = service.create_lora_training_client("tiny", rank=4, seed=2)
        for _ in range(k):  # no save_state
            _step(tc)
        before = _logprobs(tc)  # seq_id 2k + 1
        next_seq = tc.get_info().next_seq_id
        assert next_seq == 2 * k + 2

        assert srv.terminate() == 0
        log = srv.log.read_text()
        srv.start()

        info = service.get_model_info(tc.model_id)
        assert (info.version, info.next_seq_id) == (k, next_seq)  # no step lost
        assert info.last_checkpoint_seq_id == next_seq - 1
        assert "checkpointing 1 loaded model(s)" in log and "1 model(s) checkpointed" in log, log
        # The same client goes on, with no resync: nothing it was told is lost.
        np.testing.assert_allclose(_logprobs(tc), before, atol=1e-6)
        assert _step(tc) == k + 1
        service.close()


def test_sigterm_with_gradients_held_checkpoints_what_is_applied(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A model still holding gradients when the drain times out is checkpointed
    as it was before them; the client is told the forward_backward was lost."""
    with serve(tmp_path, tiny_model_dir, "--drain-timeout", "0.5") as srv:
        service = treadle.ServiceClient(srv.address, max_retries=10)
        tc = service.create_lora_training_client("tiny", rank=4, seed=3)
        assert _step(tc) == 1  # seq_ids 1, 2
        tc.forward_backward(DATA).result(TIMEOUT)  # seq_id 3: gradients held

        assert srv.terminate() == 0
        assert "checkpointed what is applied" in srv.log.read_text()
        srv.start()

        info = service.get_model_info(tc.model_id)
        assert (info.version, info.next_seq_id) == (1, 3)
        with pytest.raises(treadle.ServerRestartedError) as caught:
            tc.optim_step(ADAM).result(GAP_TIMEOUT_S / 3)  # seq_id 4
        assert (caught.value.step, caught.value.seq_id) == (1, 2)
        assert tc.resync() == 3
        assert _step(tc) == 2
        service.close()


def test_a_second_signal_stops_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    with serve(tmp_path, tiny_model_dir, "--drain-timeout", "120") as srv:
        service = treadle.ServiceClient(srv.address, max_retries=10)
        tc = service.create_lora_training_client("tiny", rank=4, seed=4)
        tc.forward_backward(DATA).result(TIMEOUT)  # seq_id 1: gradients held, not idle
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TIMEOUT
        while b"checkpointing 1 loaded model(s)" not in srv.log.read_bytes():
            assert time.monotonic() < deadline, srv.log.read_text()
            time.sleep(0.1)
        t0 = time.monotonic()
        assert srv.terminate() == 1  # the second signal
        assert time.monotonic() - t0 < 10
        assert "stopping now, without checkpointing" in srv.log.read_text()
        srv.start()

        info = service.get_model_info(tc.model_id)
        assert (info.version, info.next_seq_id) == (0, 1)  # its creation state
        with pytest.raises(treadle.ServerRestartedError) as caught:
            tc.optim_step(ADAM).result(GAP_TIMEOUT_S / 3)
        assert (caught.value.step, caught.value.seq_id, caught.value.checkpoint) == (0, 0, "")
        service.close()


def test_embedded_server_stop_with_checkpoint_is_the_graceful_stop(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``EmbeddedServer.stop(checkpoint=True)`` (demo, benchmarks) stops as
    ``treadle serve`` does on SIGTERM; plain ``stop()`` stays a crash."""
    from treadle.server.config import ServerConfig
    from treadle.server.embedded import EmbeddedServer

    def config(port: int = 0) -> ServerConfig:
        return ServerConfig(
            data_dir=tmp_path / "data", models={"tiny": tiny_model_dir}, port=port, threads=1
        )

    srv = EmbeddedServer(config()).start()
    port = srv.port
    service = treadle.ServiceClient(srv.address)
    try:
        kept = service.create_lora_training_client("tiny", rank=4, seed=5)
        assert _step(kept) == 1
    finally:
        srv.stop(checkpoint=True)
    srv = EmbeddedServer(config(port)).start()
    try:
        info = service.get_model_info(kept.model_id)
        assert (info.version, info.next_seq_id) == (1, 3)
        assert _step(kept) == 2  # no resync: nothing it was told is lost
        lost = service.create_lora_training_client("tiny", rank=4, seed=5)
        assert _step(lost) == 1
    finally:
        srv.stop()
    srv = EmbeddedServer(config(port)).start()
    try:
        assert service.get_model_info(lost.model_id).version == 0
        assert service.get_model_info(kept.model_id).version == 1  # its SIGTERM checkpoint
    finally:
        service.close()
        srv.stop()


def test_sigterm_during_a_running_loop_loses_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The loop runs on while the server is stopped (SIGTERM) and started again:
    every call is answered, none raises, and the model ends where the same loop
    without a restart ends."""
    import threading

    steps = 8
    with serve(tmp_path, tiny_model_dir) as srv:
        service = treadle.ServiceClient(srv.address, max_retries=10)
        reference = service.create_lora_training_client("tiny", rank=4, seed=6)
        for _ in range(steps):
            _step(reference)
        expected = _logprobs(reference)

        tc = service.create_lora_training_client("tiny", rank=4, seed=6)
        done: list[int] = []
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                for _ in range(steps):
                    done.append(_step(tc))
                    time.sleep(0.2)  # the client thinks (rewards...): the model goes idle
            except BaseException as err:
                errors.append(err)

        runner = threading.Thread(target=loop)
        runner.start()
        deadline = time.monotonic() + TIMEOUT
        while len(done) < 2:
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.05)
        assert srv.terminate() == 0
        assert len(done) < steps  # the loop was still running when the server stopped
        srv.start()
        runner.join(TIMEOUT)
        assert not errors, errors
        assert done == list(range(1, steps + 1))
        np.testing.assert_allclose(_logprobs(tc), expected, atol=1e-5)
        service.close()
