"""``--ranks`` and the other flags of a worker group (issue 36): bad values stop
``treadle serve`` and ``treadle worker`` with exit status 2 and a message naming
the flag; a rendezvous endpoint where nothing answers too."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from treadle.server.cli import main
from treadle.workers.engine.options import EngineOptions
from treadle.workers.group.collectives import merge_results, split
from treadle.workers.group.options import check_group
from treadle.workers.model.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny")


BAD = [
    (["--ranks", "0"], "--ranks: 0"),
    (["--ranks", "-2"], "--ranks: -2"),
    (["--nnodes", "0"], "--nnodes: 0"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank: 2"),
    (["--nnodes", "2"], "--rdzv-endpoint: several hosts"),
    (["--rdzv-endpoint", "no-port"], "--rdzv-endpoint: 'no-port'"),
    (["--rdzv-endpoint", "h:99999"], "--rdzv-endpoint: 'h:99999'"),
    (["--collective-timeout", "0"], "--collective-timeout: 0"),
]


@pytest.mark.parametrize(("flags", "message"), BAD)
def test_serve_refuses_bad_group_flags(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    argv = ["serve", "--model", f"tiny={model}", "--data-dir", str(tmp_path), *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_distributed_server_refuses_ranks(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--model", f"tiny={model}", "--data-dir", str(tmp_path), "--ranks", "2"]
    assert main([*argv, "--broker", "redis://localhost:6379/0"]) == 2
    assert "--ranks: a distributed server (--broker) runs no engine" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), BAD[:2])
def test_worker_refuses_bad_group_flags(
    model: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    argv = ["worker", "--model", f"tiny={model}", "--broker", "redis://localhost:6379/0"]
    argv += ["--database-url", "sqlite:///x.db", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_more_ranks_than_gpus_is_refused_naming_the_flag() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch sees none): the check counts GPUs")
    options = EngineOptions(device="cuda", ranks=torch.cuda.device_count() + 1)
    with pytest.raises(Exception, match="--ranks"):
        check_group(options)


@pytest.mark.slow
def test_a_rendezvous_endpoint_that_does_not_answer(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["serve", "--model", f"tiny={model}", "--data-dir", str(tmp_path)]
    argv += ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    assert main(argv) == 2
    assert "--rdzv-endpoint: nothing answers" in capsys.readouterr().err


def test_shares_are_contiguous_and_rank_0_takes_the_larger() -> None:
    assert split(3, 2) == [range(0, 2), range(2, 3)]
    assert split(1, 2) == [range(0, 1), range(1, 1)]
    assert split(4, 2) == [range(0, 2), range(2, 4)]


def test_metrics_merge_as_one_rank_would_report_them() -> None:
    import numpy as np

    from treadle.common.engine.domain import ForwardResult

    a = ForwardResult((np.zeros(2),), {"loss:sum": 1.5, "ntokens:sum": 3.0, "x:mean": 1.0})
    b = ForwardResult(
        (np.ones(1),), {"loss:sum": 2.0, "ntokens:sum": 1.0, "x:mean": 5.0, "y:max": 4.0}
    )
    merged = merge_results([a, b, None])
    assert merged.metrics == {"loss:sum": 3.5, "ntokens:sum": 4.0, "x:mean": 2.0, "y:max": 4.0}
    assert [len(lp) for lp in merged.logprobs] == [2, 1]
