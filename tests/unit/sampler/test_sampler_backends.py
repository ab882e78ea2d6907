"""Choosing the sampler backend: ``--sampler``, its deprecated aliases, and a
backend that cannot run here refused at start (``workers.sampler.backends``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.sampler_backends import vllm_imports
from treadle.errors import FailedPreconditionError, InvalidArgumentError
from treadle.workers.engine.flags import add_engine_flags, engine_config, engine_settings
from treadle.workers.sampler import backends as sampler_backends


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "sampler"),
    [
        ((), "torch"),
        (("--sampler", "torch-thread"), "torch-thread"),
        (("--sampler", "torch-process"), "torch-process"),
        (("--sampler-thread",), "torch-thread"),  # deprecated alias
        (("--sampler-process",), "torch-process"),  # deprecated alias
    ],
)
def test_the_flag_reaches_the_engine_config(
    tmp_path: Path, argv: tuple[str, ...], sampler: str
) -> None:
    from treadle.server.config import ServerConfig

    settings = engine_settings(_parse(*argv, "--sampler-threads", "1"))
    made = engine_config(ServerConfig(data_dir=tmp_path, **settings), {}, None)
    assert (made.sampler, made.sampler_threads) == (sampler, 1)


def test_the_old_environment_variables_still_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_SAMPLER_PROCESS", "1")
    assert _parse().sampler == "torch-process"
    monkeypatch.setenv("TREADLE_SAMPLER", "torch-thread")  # the new one wins
    assert _parse().sampler == "torch-thread"


def test_an_unknown_backend_is_invalid(tmp_path: Path) -> None:
    from treadle.server.config import ServerConfig

    with pytest.raises(InvalidArgumentError, match="sampler: 'tgi'; choose from torch"):
        ServerConfig(data_dir=tmp_path, sampler="tgi")


@pytest.mark.skipif(vllm_imports(), reason="vllm imports here")
def test_vllm_without_vllm_fails_at_start_naming_the_extras(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from treadle.server.cli import main

    with pytest.raises(FailedPreconditionError, match=r"treadle\[vllm-cpu\]"):
        sampler_backends.check_available("vllm")
    model = tmp_path / "m"
    model.mkdir()
    status = main(
        ["serve", "--model", f"m={model}", "--data-dir", str(tmp_path), "--sampler", "vllm"]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert "treadle[vllm]" in err and "treadle[vllm-cpu]" in err
