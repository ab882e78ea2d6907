"""Subprocesses of the benchmarks: wait for a line in a server's log, stop them.
No side effects on import (no thread settings), so any benchmark may use it."""

from __future__ import annotations

import re
import subprocess
import time
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
