"""vLLM split over a worker group (issue 36, item 5): ``treadle serve --ranks 2
--sampler vllm`` starts each vLLM engine with ``tensor_parallel_size=2`` (on this
CPU host two vLLM workers, one core each), and what it samples equals a one-rank
server's engine (tensor parallelism 1) under the same seeds: a LoRA tenant's
trained version, and a full fine-tune's trained version (which a
group keeps sharded over its ranks and gathers for vLLM's weight reload).

Real processes: two ``treadle serve`` subprocesses, one after the other, each
with its own vLLM engines (tens of seconds each to start on 2 cores). Each is
then SIGKILLed, and its vLLM processes (engine cores, tensor-parallel workers)
must end by themselves (``workers/vllm/orphan_guard.py``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.conftest import vllm_skip_reason
from tests.integration.faults.test_restarts import Serve, _step, serve

pytestmark = pytest.mark.slow

FLAGS = ("--sampler", "vllm", "--sampler-slots", "8", "--sampler-max-len", "128")
PROMPT = [1, 5, 9, 12]
PARAMS = treadle.SamplingParams(max_tokens=12, temperature=1.0, seed=7)


def _samples(srv_address: str) -> dict[str, tuple[list[list[int]], np.ndarray]]:
    out = {}
    with treadle.ServiceClient(srv_address) as service:
        samplers = {
            "lora": _trained(service.create_lora_training_client("tiny", rank=4, seed=0)),
            "full": _trained(service.create_training_client("tiny", seed=0)),
        }
        for name, sampler in samplers.items():
            res = sampler.sample(PROMPT, 2, PARAMS).result(timeout=900)
            for seq in res.sequences:  # the trained version (2 steps), not the base
                assert set(seq.token_versions()) == {2}, (name, seq.versions)
            tokens = [list(s.tokens) for s in res.sequences]
            out[name] = (tokens, np.concatenate([np.asarray(s.logprobs) for s in res.sequences]))
    return out


def _trained(tc: treadle.TrainingClient) -> treadle.SamplingClient:
    for _ in range(2):
        _step(tc)
    return tc.sync_weights()


def test_a_two_rank_group_samples_on_a_tensor_parallel_engine_as_one_rank_does(
    tmp_path: Path, vllm_model_dir: Path
) -> None:
    reason = vllm_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    with serve(tmp_path / "one", vllm_model_dir, *FLAGS) as srv:
        one = _samples(srv.address)
        assert "tensor_parallel_size=1" in srv.log.read_text()  # vLLM's own config line
        _killed_with_its_vllm_processes(srv, at_least=2)  # the LoRA engine, the full one's
    with serve(tmp_path / "two", vllm_model_dir, *FLAGS, "--ranks", "2") as srv:
        two = _samples(srv.address)
        log = srv.log.read_text()
        assert "tensor_parallel_size=2" in log, log[-3000:]
        _killed_with_its_vllm_processes(srv, at_least=6)  # two engines: a core and 2 workers each
    for name in ("lora", "full"):
        assert two[name][0] == one[name][0], name
        np.testing.assert_allclose(two[name][1], one[name][1], atol=1e-4, err_msg=name)


def _vllm_processes(owner: int) -> list[int]:
    """The processes whose environment names ``owner`` as their treadle process."""
    mark = f"TREADLE_VLLM_OWNER_PID={owner}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if int(pid) != owner and mark in environ.split(b"\0") and state != "Z":
            found.append(int(pid))
    return found


def _killed_with_its_vllm_processes(srv: Serve, at_least: int) -> None:
    assert srv.proc is not None
    owner = srv.proc.pid
    assert len(_vllm_processes(owner)) >= at_least, _vllm_processes(owner)
    srv.kill()  # SIGKILL: the server cannot stop its engines
    deadline = time.monotonic() + 30
    while left := _vllm_processes(owner):
        assert time.monotonic() < deadline, f"vLLM processes outlived their server: {left}"
        time.sleep(0.2)
