"""A PostgreSQL server of one test alone (``initdb`` + ``pg_ctl`` in a temp dir, on
a free port), so a test can stop and start it: the shared one is never touched.
As root, the server runs as the ``postgres`` user (PostgreSQL refuses root)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from .services import free_port


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    if found:
        return Path(found[-1])
    initdb = shutil.which("initdb")
    if initdb is None:
        pytest.skip("PostgreSQL's initdb and pg_ctl are not installed")
    return Path(initdb).parent


class PrivatePostgres:
    """``start()``, ``stop()`` (fast shutdown: open connections are cut, as in a
    restart) and ``url``, with trust authentication on 127.0.0.1 only."""

    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.port = free_port()
        # not under pytest's tmp_path: its parents are private to this user
        self.root = Path(tempfile.mkdtemp(prefix="treadle-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._as: list[str] = []
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root and there is no postgres user to run PostgreSQL")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [*self._as, str(self.bin / tool), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{tool} failed: {done.stdout}{done.stderr}\n{log}")

    def start(self) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "start")
        deadline = time.monotonic() + 30
        while not self.ready():
            assert time.monotonic() < deadline, "PostgreSQL did not accept connections"
            time.sleep(0.1)

    def ready(self) -> bool:
        cmd = [str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)]
        return subprocess.run(cmd, capture_output=True).returncode == 0

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def close(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
