"""Shared fixtures: tiny models built on the spot, and servers bound to port 0."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TREADLE_CACHE_DIR", str(Path(__file__).parent / ".cache"))
# Auth is on in tests as in production. Every embedded server a test starts gives
# its default tenant this key (EmbeddedServer), and ServiceClient reads it.
os.environ.setdefault("TREADLE_API_KEY", "tdl-" + secrets.token_urlsafe(32))

import treadle  # noqa: E402
from treadle.server.config import ServerConfig  # noqa: E402
from treadle.server.embedded import EmbeddedServer  # noqa: E402
from treadle.workers.model.tiny import build_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_gpu = False
    # TREADLE_TEST_DEVICE=cpu runs the gpu-marked checks on the CPU (tests/gpu)
    if not has_gpu and os.environ.get("TREADLE_TEST_DEVICE", "cuda") != "cpu":
        skip = pytest.mark.skip(
            reason="needs a CUDA GPU (torch sees none); TREADLE_TEST_DEVICE=cpu runs it on the CPU"
        )
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs the CLI in-process (``cli.main`` configures the root
    logger, as a ``treadle`` process does) leaves a handler writing to the
    stream pytest captured the test's stderr in, closed once the test ends;
    every later log line of the session (a heartbeat thread's, at exit too)
    then prints "--- Logging error --- ValueError: I/O operation on closed
    file". The root logger's handlers and level are put back after each test
    (pytest's own capture handlers are left to pytest)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama-style model (random weights, char tokenizer), built once."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)


def make_server(tmp: Path, models: dict[str, Path], **overrides: object) -> EmbeddedServer:
    config = ServerConfig(data_dir=tmp / "data", models=models, port=0, threads=1, **overrides)  # type: ignore[arg-type]
    return EmbeddedServer(config).start()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[EmbeddedServer]:
    """An embedded server (SQLite, local checkpoints, in-process engine) on port 0."""
    srv = make_server(tmp_path_factory.mktemp("server"), {"tiny": tiny_model_dir})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def service(server: EmbeddedServer) -> Iterator[treadle.ServiceClient]:
    client = treadle.ServiceClient(server.address, api_key=server.api_key)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tok(service: treadle.ServiceClient) -> treadle.Tokenizer:
    """The tokenizer of the tiny base model, as the server serves it."""
    return service.get_tokenizer("tiny")


def vllm_skip_reason() -> str | None:
    """Why the vLLM backend's tests cannot run here (None: they can)."""
    from treadle.errors import TreadleError
    from treadle.workers.sampler.backends import check_available

    try:
        check_available("vllm")
    except TreadleError as err:
        return f"the vllm sampler backend cannot run here: {err}"
    return None


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 5m preset (head_dim 32, which vLLM's CPU attention takes), built once."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "5m", preset="5m", seed=0)


#: what the session's vLLM server serves: the 5m preset under the name the backend
#: conformance suite samples ("tiny"; the tiny preset's head_dim 16 is not one vLLM's
#: CPU attention is known to take), with the suite's sizes
VLLM_BASE = "tiny"
VLLM_SETTINGS: dict[str, object] = {
    "sampler": "vllm",
    "sampler_slots": 16,
    "sampler_max_len": 1024,
    "sampler_options": {"max_lora_rank": 8, "max_loras": 4},
}


@pytest.fixture(scope="session")
def vllm_server(
    tmp_path_factory: pytest.TempPathFactory, vllm_model_dir: Path
) -> Iterator[EmbeddedServer]:
    """One server with ``--sampler vllm`` for the whole session, its engines started
    here (on a CPU host the base model's and its LoRA tenants'): a vLLM engine
    takes 15 s to minutes to start on 2 busy cores, so every vLLM test (the
    conformance suite's vllm case too) shares this one."""
    reason = vllm_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    srv = make_server(
        tmp_path_factory.mktemp("vllm-server"), {VLLM_BASE: vllm_model_dir}, **VLLM_SETTINGS
    )
    with treadle.ServiceClient(srv.address, api_key=srv.api_key) as client:
        warm = client.create_sampling_client(base_model=VLLM_BASE).sample([1, 2], 1)
        lora = client.create_lora_training_client(VLLM_BASE, rank=4).sync_weights()
        warm_lora = lora.sample([1, 2], 1)
        warm.result(timeout=900)
        warm_lora.result(timeout=900)
    yield srv
    srv.stop()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="tests/reliability: the long fuzz profile (thousands of cases per RPC)",
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.reliability import stats

    stats.report(terminalreporter.write_line)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh database on the test PostgreSQL, dropped afterwards (skips the test
    when PostgreSQL is unreachable)."""
    from tests.integration.services import fresh_postgres

    with fresh_postgres("treadle_test") as url:
        yield url


class IdleHost:
    """A host whose cores no other process uses: ``host_load.HOST`` for tests of
    the measured thread choice, which must not depend on what else runs beside
    them (``workers.device.pass_threads`` caps a busy host's passes at one thread)."""

    cores = 2

    def spare_cores(self) -> float:
        return 2.0

    def others_busy(self) -> float:
        return 0.0


@pytest.fixture
def idle_host(monkeypatch: pytest.MonkeyPatch) -> IdleHost:
    from treadle.workers.device import host_load

    host = IdleHost()
    monkeypatch.setattr(host_load, "HOST", host)
    return host
