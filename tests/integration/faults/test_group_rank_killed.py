"""A rank of a worker group killed (SIGKILL) in the middle of ``forward_backward``
(issue 36, "Faults"): the call fails UNAVAILABLE (gloo sees the peer gone; at
the latest after ``--collective-timeout``), no rank is left running, the worker
restarts its group by itself (it re-executes itself, ``--group-restarts``) and
brings the model back at its last applied step (auto-checkpoint every step: the
checkpoint is the last applied step); with ``--group-restarts 0`` it exits with
status 1 for its supervisor instead."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.helpers import next_token_datum
from tests.integration.faults.test_restarts import DATA, TIMEOUT, _logprobs, _step, serve
from tests.integration.services import port_open

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _ranks_of(pid: int) -> list[int]:
    """The rank processes ``pid`` started (multiprocessing's spawned children)."""
    out = []
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in map(int, children):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline:
            out.append(child)
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_computing(pid: int, since: float, cpu_s: float = 0.2, timeout_s: float = 60.0) -> None:
    """Until the process ``pid`` has spent ``cpu_s`` more CPU seconds than ``since``
    (its CPU time before the call was sent): the call is running there (a fixed
    sleep let a quiet machine finish the call before the kill landed, and would let
    a busy one kill it before it started)."""
    start, deadline = since, time.monotonic() + timeout_s
    while _cpu_s(pid) - start < cpu_s:
        assert time.monotonic() < deadline, f"process {pid} never started computing"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}").exists() else ""
    return bool(stat) and stat.split()[2] != "Z"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_rank_killed_mid_forward_backward(
    tmp_path: Path, tiny_model_dir: Path, lora: bool
) -> None:
    """A full fine-tune's FSDP pass, or a LoRA model's on its sharded base."""
    flags = ("--ranks", "2", "--auto-checkpoint-steps", "1", "--collective-timeout", "30")
    with serve(tmp_path, tiny_model_dir, *flags) as srv:
        assert srv.proc is not None
        ranks = _ranks_of(srv.proc.pid)
        assert len(ranks) == 1, ranks  # rank 1; rank 0 is the server process
        service = treadle.ServiceClient(srv.address, max_retries=0)
        if lora:
            tc = service.create_lora_training_client("tiny", rank=4, seed=0)
        else:
            tc = service.create_training_client("tiny", seed=0)
        assert _step(tc) == 1
        assert _step(tc) == 2
        applied = _logprobs(tc)

        # long enough (seconds) for the kill to land while the ranks compute
        rng = np.random.default_rng(0)  # rows of their own: a shared prefix is computed once
        big = [next_token_datum([int(t) for t in rng.integers(3, 60, 122)]) for _ in range(512)]
        before = _cpu_s(ranks[0])
        fb = tc.forward_backward(big, "cross_entropy")
        wait_computing(ranks[0], since=before)
        os.kill(ranks[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(treadle.UnavailableError):
            fb.result(TIMEOUT)
        assert time.monotonic() - t0 < 30 + 10  # within --collective-timeout
        # the worker restarts its group by itself (--group-restarts, default 3): the
        # same process re-executed, a fresh rank 1, the port served again
        deadline = time.monotonic() + 120
        while not (
            "restart 1 of --group-restarts 3" in srv.log.read_text(errors="replace")
            and [r for r in _ranks_of(srv.proc.pid) if r not in ranks]
            and port_open("127.0.0.1", srv.port)
            and srv.log.read_text(errors="replace").count("treadle: serving") == 2
        ):
            assert srv.proc.poll() is None, srv.log.read_text()[-3000:]
            assert time.monotonic() < deadline, srv.log.read_text()[-3000:]
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks)
        assert len(_ranks_of(srv.proc.pid)) == 1
        with pytest.raises(treadle.ServerRestartedError):
            tc.forward_backward(DATA).result(TIMEOUT)
        tc.resync()
        assert tc.get_info().version == 2  # its last applied step
        np.testing.assert_allclose(_logprobs(tc), applied, rtol=0, atol=1e-6)
        assert _step(tc) == 3  # and it trains on, on the new group
        service.close()


def test_a_hung_rank_fails_the_call_after_the_collective_timeout(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """SIGSTOP: the rank neither answers nor closes its sockets; the collective
    gives up after ``--collective-timeout`` and the stopped rank is killed."""
    flags = ("--ranks", "2", "--collective-timeout", "5", "--group-restarts", "0")
    with serve(tmp_path, tiny_model_dir, *flags) as srv:
        assert srv.proc is not None
        (rank,) = _ranks_of(srv.proc.pid)
        service = treadle.ServiceClient(srv.address, max_retries=0)
        tc = service.create_training_client("tiny", seed=0)
        assert _step(tc) == 1
        os.kill(rank, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(treadle.UnavailableError, match="collective"):
            tc.forward_backward(DATA, "cross_entropy").result(TIMEOUT)
        waited = time.monotonic() - t0
        assert 4 < waited < 5 + 30, waited
        assert srv.proc.wait(60) == 1  # no restart allowed: it exits for its supervisor
        assert not _alive(rank)
