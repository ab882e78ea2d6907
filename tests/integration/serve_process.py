"""``treadle serve`` as a user starts it: a process of its own, its output in a
file, ready once it has printed where its HTTP API listens."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CLI = (sys.executable, "-m", "treadle.server.cli")
HTTP_LINE = re.compile(r"tinker-compatible HTTP API on (http://\S+)")
KEY_LINE = re.compile(r"the default tenant's API key is in (\S+) ")


def free_port_pair() -> int:
    """A free port whose next port is free too (the default HTTP port is --port + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two adjacent free ports")


class ServeProcess:
    def __init__(self, tmp: Path, model: str | Path, *args: str, name: str = "serve") -> None:
        """``model``: the ``--model`` value (``DIR`` or ``NAME=DIR``)."""
        self.log = tmp / f"{name}.log"
        self.cmd = [
            *CLI,
            "serve",
            "--model",
            str(model),
            "--data-dir",
            str(tmp / f"{name}-data"),
            "--threads",
            "1",
            *args,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("TREADLE_API_KEY", None)
        env.pop("TREADLE_HTTP_PORT", None)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_serving(self, timeout_s: float = 240) -> tuple[str, str]:
        """(the HTTP API's URL, the default tenant's key) once it says both."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.output()
            url, key = HTTP_LINE.search(text), KEY_LINE.search(text)
            if url and key:
                return url.group(1), Path(key.group(1)).read_text().strip()
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"treadle serve exited {self.proc.returncode}:\n{text[-3000:]}"
                )
            time.sleep(0.2)
        raise AssertionError(f"treadle serve did not come up:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
