"""``--drain-timeout`` has two defaults on purpose, 30 s for ``treadle serve`` and
60 s for ``treadle worker`` (a worker that runs out loses the models it still holds;
a server that runs out still checkpoints what is applied). Each flag defaults to its
config's field, and the settings table of docs/restarts.md states both."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from treadle.server.config import ServerConfig, add_server_flags
from treadle.workers.worker.config import WorkerConfig, add_worker_flags

DOC = Path(__file__).resolve().parents[3] / "docs" / "restarts.md"


def _default(config: type, name: str) -> object:
    return next(f.default for f in dataclasses.fields(config) if f.name == name)


def _flag_default(add: Callable[[argparse.ArgumentParser], None]) -> float:
    parser = argparse.ArgumentParser()
    add(parser)
    known, _ = parser.parse_known_args([])
    return float(known.drain_timeout)


def test_each_flag_defaults_to_its_config_and_the_worker_waits_longer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in os.environ if n.startswith("TREADLE_")]:
        monkeypatch.delenv(name)
    server, worker = (
        _default(ServerConfig, "drain_timeout_s"),
        _default(WorkerConfig, "drain_timeout_s"),
    )
    assert _flag_default(add_server_flags) == server
    assert _flag_default(add_worker_flags) == worker
    assert isinstance(server, float) and isinstance(worker, float) and worker > server


def test_the_settings_table_states_both_defaults() -> None:
    row = next(
        line for line in DOC.read_text().splitlines() if line.startswith("| `--drain-timeout`")
    )
    found = re.search(r"\| (\d+) s \(`treadle serve`\), (\d+) s \(`treadle worker`\) \|", row)
    assert found, row
    assert float(found[1]) == _default(ServerConfig, "drain_timeout_s")
    assert float(found[2]) == _default(WorkerConfig, "drain_timeout_s")
