"""Subprocesses of the benchmarks: wait for a line in a server's log, stop them.
No side effects on import (no thread settings), so any benchmark may use it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def wait_for(path: Path, pattern: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first group of ``pattern`` once it appears in the file ``path`` (a
    process's log); RuntimeError with the log's tail if ``proc`` exits first or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text(errors="replace")) if path.exists() else None
        if found:
            return found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(
        f"{' '.join(map(str, proc.args))} did not start:\n{path.read_text()[-2000:]}"
    )


def stop_all(procs: list[subprocess.Popen[bytes]], timeout_s: float = 60.0) -> None:
    """SIGTERM to each; SIGKILL to any still running ``timeout_s`` later."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()


def die_with_parent() -> None:
    """In a child process (``preexec_fn``): end when the benchmark ends, however it
    ends (a benchmark killed with a signal would otherwise leave its server running)."""
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextmanager
def treadle_serve(
    flags: list[str],
    data_dir: Path,
    timeout_s: float = 120.0,
    verbose: bool = False,
    python: str | None = None,
) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    """A ``treadle serve`` process of its own with ``flags`` (``--port``, ``--http-port``
    and ``--data-dir`` are set here): (address, API key, the process) once it answers
    ``GetServerInfo``; stopped on exit. Its log is ``data_dir`` + ``.log`` (INFO
    with ``verbose``). ``python``: another installation's interpreter (an older
    checkout's virtualenv, for a before/after pair in one run)."""
    import treadle

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [python or sys.executable, "-m", "treadle.server.cli", *(["-v"] if verbose else [])]
    cmd += ["serve", "--port", str(port), "--http-port", "-1", "--data-dir", str(data_dir)]
    cmd += flags
    log = Path(data_dir).with_suffix(".log")
    Path(data_dir).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=dict(os.environ, TREADLE_API_KEY=""),  # the server's own default key
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    key_file = Path(data_dir) / "api_key"
    try:
        deadline = time.monotonic() + timeout_s
        while not key_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"treadle serve did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        address, key = f"127.0.0.1:{port}", key_file.read_text().strip()
        with treadle.ServiceClient(address, api_key=key) as client:
            while True:  # the key is written before the port listens
                try:
                    client.get_server_info()
                    break
                except treadle.TreadleError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        yield address, key, proc
    finally:
        stop_all([proc], 30)


def peak_rss_mb(pid: int) -> float:
    """A live process's peak resident memory (``VmHWM``) plus its live children's
    (a sampler or engine process of its own), in MiB; 0 where unknown. A sum of
    peaks: an upper bound of the tree's peak."""
    total = 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) / 1024
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += peak_rss_mb(int(child))
    except OSError:
        pass
    return total


def _busy_loop() -> None:
    while True:
        pass


@contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes that keep a core busy each (a contended host: tokenizers,
    reward code, other workers beside the engine), stopped on exit."""
    import multiprocessing

    procs = [multiprocessing.Process(target=_busy_loop, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(10)


def cpu_share_slowdown(busy: int, seconds: float = 1.0) -> float:
    """How much slower one thread's fixed CPU work runs with ``busy`` busy processes
    beside it than alone, measured now: the bound a contended row is held to (no
    thread policy gets a busy core back; the scheduler shares it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(256, 256)

    def work() -> float:
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < seconds:
            a @ a
            n += 1
        return (time.perf_counter() - t0) / n

    try:
        alone = work()
        with busy_processes(busy):
            time.sleep(0.2)
            shared = work()
        return shared / alone
    finally:
        torch.set_num_threads(threads)
