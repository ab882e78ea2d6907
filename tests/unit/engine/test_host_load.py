"""The engine looks at the host before it tries a second thread: cores that other
processes keep busy are not spare, and a measured pass runs on at most the spare
ones (``workers.device.host_load``, ``workers.device.pass_threads``)."""

from __future__ import annotations

import multiprocessing
import sys
import time

import pytest
import torch

from treadle.workers.device.host_load import MIN_WINDOW_S, HostLoad
from treadle.workers.device.pass_threads import pass_threads
from treadle.workers.device.thread_choice import ThreadChoice

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_other_processes_busy_cores_are_counted_and_this_ones_are_not() -> None:
    load = HostLoad()
    assert load.others_busy() is None or load.others_busy() >= 0  # a first look
    spinners = [multiprocessing.Process(target=_spin, args=(1.5,)) for _ in range(load.cores)]
    for p in spinners:
        p.start()
    time.sleep(0.3)
    load.others_busy()  # a window that starts with the spinners running
    time.sleep(0.8)
    others = load.others_busy()
    for p in spinners:
        p.join()
    assert others is not None and others >= 0.6 * load.cores
    spare = load.spare_cores()
    assert spare is not None and spare <= 0.4 * load.cores + 0.5


def test_this_processs_own_work_is_not_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's busy time less this process's: 1.5 cores busy over a second, one
    of them this process's, leaves 0.5 to the others."""
    from treadle.workers.device import host_load

    clock = {"t": 100.0, "host": 50.0, "own": 10.0}
    monkeypatch.setattr(host_load.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(host_load, "_host_busy_s", lambda cpus: clock["host"])
    monkeypatch.setattr(host_load, "_own_busy_s", lambda: clock["own"])
    load = HostLoad()
    assert load.others_busy() is None  # one look: nothing to compare with yet
    clock.update(t=101.0, host=51.5, own=11.0)
    assert load.others_busy() == pytest.approx(0.5)
    clock.update(t=101.0 + MIN_WINDOW_S / 2, host=60.0)  # too short a window: kept
    assert load.others_busy() == pytest.approx(0.5)
    monkeypatch.setattr(host_load, "_host_busy_s", lambda cpus: None)  # no /proc: unknown
    assert HostLoad().spare_cores() is None


class _Host(HostLoad):
    def __init__(self, spare: float | None) -> None:
        super().__init__()
        self.spare = spare

    def spare_cores(self) -> float | None:
        return self.spare


def test_a_measured_pass_runs_on_the_spare_cores_only() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        for spare, policy in [(0.3, "measure"), (None, "measure"), (2.0, "measure"), (0.3, "all")]:
            choice = ThreadChoice(policy)
            with pass_threads(choice, torch.device("cpu"), "decode", 1e9, _Host(spare)):
                seen.append(torch.get_num_threads())
            assert torch.get_num_threads() == 2
        # busy: one thread, not tried on two; unknown or idle: explores all first;
        # "all" is all whatever the host does
        assert seen == [1, 2, 2, 2]
    finally:
        torch.set_num_threads(before)


def test_only_the_cpus_this_process_may_use_are_read() -> None:
    """On a shared node a container's cpuset is what a second thread would share:
    the other CPUs' load is not counted (``/proc/stat``'s per-CPU lines)."""
    from treadle.workers.device import host_load

    every = host_load._host_busy_s(host_load.usable_cpus())
    one = host_load._host_busy_s(frozenset({min(host_load.usable_cpus())}))
    assert every is not None and one is not None and 0 < one <= every
    assert host_load._host_busy_s(frozenset({10**6})) is None  # no such CPU
