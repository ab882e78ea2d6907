"""Malformed database, broker or store URLs (and out-of-range settings) stop
``treadle serve`` and ``treadle worker`` at start-up with a message naming the
flag, exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle.server.cli import main
from treadle.workers.model.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--database-url", "postgres://u@h/db"], "psycopg"),
        (["--database-url", "mysql://u@h/db"], "database_url"),
        (["--database-url", "::not a url::"], "database_url"),
        (["--broker", "http://localhost:6379"], "broker"),
        (["--broker", "redis://localhost:notaport/0"], "broker"),
        (["--broker", "amqp://"], "broker"),
        (["--store", "gs://bucket/x"], "store"),
        (["--store", "s3:///no-bucket"], "store"),
    ],
)
def test_serve_refuses_malformed_urls(
    model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    argv = ["serve", "--model", f"tiny={model}", "--data-dir", str(tmp_path), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "treadle:" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "broker: required"),
        (["--broker", "redis://localhost:6379/0"], "database_url: required"),
        (["--broker", "redis://localhost:6379/0", "--database-url", "postgres://x/y"], "psycopg"),
        (["--broker", "kafka://x", "--database-url", "sqlite:///x.db"], "broker"),
    ],
)
def test_worker_refuses_malformed_urls(
    model: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["worker", "--model", f"tiny={model}", *flags]) == 2
    assert message in capsys.readouterr().err


def test_worker_refuses_a_negative_drain_timeout(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--broker", "redis://localhost:6379/0", "--database-url", "sqlite:///x.db"]
    assert main(["worker", "--model", f"tiny={model}", *flags, "--drain-timeout", "-1"]) == 2
    assert "drain_timeout_s: out of range" in capsys.readouterr().err


def _exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:  # argparse refuses a choice before main runs
        return int(stop.code or 0)


def test_an_unknown_worker_role_or_sampler_placement_names_the_flag(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    worker = ["worker", "--model", f"tiny={model}", "--broker", "redis://localhost:6379/0"]
    assert _exit_status([*worker, "--role", "rollout"]) == 2
    err = capsys.readouterr().err
    assert "--role" in err and "rollout" in err and "sampler" in err
    serve = ["serve", "--model", f"tiny={model}", "--data-dir", str(tmp_path)]
    assert _exit_status([*serve, "--sampler-placement", "elsewhere"]) == 2
    err = capsys.readouterr().err
    assert "--sampler-placement" in err and "pool" in err


def test_the_role_is_checked_where_the_config_is_made(model: Path) -> None:
    from treadle.errors import InvalidArgumentError
    from treadle.server.config import ServerConfig
    from treadle.workers.worker.config import WorkerConfig

    with pytest.raises(InvalidArgumentError, match=r"role: 'rollout'.*\(--role\)"):
        WorkerConfig(
            models={"tiny": model},
            broker="redis://localhost:6379/0",
            database_url="sqlite:///x.db",
            role="rollout",
        )
    with pytest.raises(InvalidArgumentError, match=r"--sampler-placement"):
        ServerConfig(models={"tiny": model}, sampler_placement="elsewhere")
