"""The host allocator: "reuse" makes a step's freed memory come back without
page faults; "system" leaves malloc's defaults (each large block fresh pages).
Each case runs in its own process: the setting is process-wide and once."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

import pytest

from treadle.workers.device import host_allocator
from treadle.workers.engine import flags as engine_flags
from treadle.workers.engine.options import EngineOptions

glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="mallopt's settings are glibc's"
)

# A step's worth of large temporaries (64 MB each, over glibc's largest mmap
# threshold), allocated, written and freed 16 times from a thread that is not
# the main one (the engine's own thread); the minor faults of each step. With
# "reuse" the heap grows for the first few steps (a freed block with a small live
# one after it is not quite the next one's size), then holds (seen: from the 5th
# to the 7th step on, none).
_STEPS = """
import json, resource, sys, threading
import torch
from treadle.workers.device import host_allocator
took = host_allocator.configure(sys.argv[1])
faults = []
def steps():
    for _ in range(16):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tensors = [torch.ones(16 * 2**20) for _ in range(3)]
        del tensors
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=steps)
t.start(); t.join()
print(json.dumps({"took": took, "faults": faults}))
"""

PAGES = 3 * 64 * 2**20 // 4096  # the pages of one step's tensors


def _steps(allocator: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, allocator], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.splitlines()[-1])


@glibc
def test_reuse_takes_freed_memory_back_without_page_faults() -> None:
    got = _steps("reuse")
    assert got["took"] is True
    assert sum(got["faults"][-4:]) < PAGES // 20, got


@glibc
def test_system_leaves_malloc_giving_large_blocks_back() -> None:
    got = _steps("system")
    assert got["took"] is False
    assert min(got["faults"][-4:]) > PAGES // 2, got  # each step: what "reuse" saves


def test_an_unknown_allocator_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="reuse"):
        host_allocator.configure("jemalloc")
    with pytest.raises(Exception, match="host_allocator: 'jemalloc'; choose from"):
        engine_flags.check_engine_settings(EngineOptions(host_allocator="jemalloc"))


def test_the_flag_and_its_variable_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_HOST_ALLOCATOR", "system")
    parser = argparse.ArgumentParser()
    engine_flags.add_engine_flags(parser)
    assert engine_flags.engine_settings(parser.parse_args([]))["host_allocator"] == "system"
    args = parser.parse_args(["--host-allocator", "reuse"])
    assert engine_flags.engine_settings(args)["host_allocator"] == "reuse"
